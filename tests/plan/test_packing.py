"""How a step's calls pack into Dask tasks (``rpeg.plan.packing``), the rule the runtime's
fusion runs by and the cost model counts with: a call joins a task only where every
unfinished dependency is in it or waited for by it, on its own device and step; a rank of a
collective starts a task; a call read elsewhere ends its task but for its fused stages."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg.plan.packing import Packer


@st.composite
def batches(draw):
    """Calls (device, step, chunk, op, deps as earlier call indices, collective, read
    elsewhere), dependencies first."""
    n = draw(st.integers(1, 30))
    out = []
    for i in range(n):
        deps = draw(st.sets(st.integers(0, i - 1), max_size=3)) if i else set()
        out.append((draw(st.integers(0, 2)), draw(st.integers(0, 1)), draw(st.integers(0, 1)),
                    draw(st.sampled_from("abc")), deps, draw(st.booleans()),
                    draw(st.booleans())))
    return out


@settings(deadline=None)
@given(batches(), st.booleans())
def test_a_call_joins_only_a_task_that_holds_or_waits_for_its_inputs(batch, fused):
    pack = Packer((("a", "b"),) if fused else ())
    task: list[int] = []
    members: dict[int, list[int]] = {}
    for i, (dev, step, chunk, op, deps, collective, elsewhere) in enumerate(batch):
        need = {task[d] for d in deps}
        g = pack.place(dev, step, chunk, op, need, need, collective=collective)
        if g in members:                                   # joined a task
            first = batch[members[g][0]]
            assert not collective
            assert (first[0], first[1]) == (dev, step)
            assert all(d == g or d in pack.waits[g] for d in need)
        else:
            assert g == len(pack.waits) - 1 and pack.waits[g] == need
        members.setdefault(g, []).append(i)
        task.append(g)
        if elsewhere:
            pack.read_elsewhere(dev, g, step, chunk, op)
    # no task waits for itself, nor for a task started after it
    assert all(all(d < g for d in w) for g, w in enumerate(pack.waits))


def test_a_call_read_elsewhere_ends_its_task_but_for_its_fused_stages():
    pack = Packer((("ref_lp", "scores"),))
    a = pack.place(0, 0, 0, "ref_lp", set(), set())
    pack.read_elsewhere(0, a, 0, 0, "ref_lp")
    assert pack.place(0, 0, 0, "scores", {a}, {a}) == a          # fused with it
    assert pack.place(0, 0, 1, "scores", {a}, {a}) != a          # another chunk's
    plain = Packer()
    b = plain.place(0, 0, 0, "ref_lp", set(), set())
    plain.read_elsewhere(0, b, 0, 0, "ref_lp")
    assert plain.place(0, 0, 0, "scores", {b}, {b}) != b
