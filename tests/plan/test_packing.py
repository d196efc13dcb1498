"""How a step's calls pack into Dask tasks (``rpeg.plan.packing``), the rule the runtime's
fusion runs by and the cost model counts with: a call joins a task only where every
unfinished dependency is in it or waited for by it, on its own device and step; a rank of a
collective starts a task; a call read elsewhere ends its task but for its fused stages."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg.cost.control import JOIN_MIN
from rpeg.plan.packing import Packer, Unit


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


class _Reference:
    """The packing rule as first written (every candidate task of the first dependency's
    waiters, sorted), kept to check that a faster :class:`Packer` packs exactly the same."""

    def __init__(self, together=()) -> None:
        self.waits: list[set] = []
        self._waiting: dict = {}
        self._open: dict = {}
        self._sealed: dict = {}
        self._partners: dict[str, set[str]] = {}
        for names in together:
            names = tuple(names)
            for a in names:
                self._partners.setdefault(a, set()).update(set(names) - {a})

    def new(self, deps):
        self.waits.append(set(deps))
        g = len(self.waits) - 1
        for d in deps:
            self._waiting.setdefault(d, []).append(g)
        return g

    def place(self, device, step, chunk, op, need, deps, collective=False):
        key = (device, step)
        here = self._open.setdefault(key, [])
        if not collective:
            g = self._fitting(here, need)
            if g is None:
                g = next((t for t, (c, ops) in reversed(self._sealed.get(key, {}).items())
                          if op in ops and c == chunk and self._fits(t, need)), None)
            if g is not None:
                return g
        g = self.new(deps)
        here.append(g)
        return g

    def read_elsewhere(self, device, task, step, chunk, op):
        here = self._open.get((device, step), [])
        if task in here:
            here.remove(task)
        if self._partners.get(op):
            self._sealed.setdefault((device, step), {})[task] = (chunk, self._partners[op])

    def _fits(self, g, need):
        return all(d == g or d in self.waits[g] for d in need)

    def _fitting(self, here, need):
        if not need:
            return here[-1] if here else None
        d0 = next(iter(need))
        for g in sorted(set(self._waiting.get(d0, ())).union((d0,)).intersection(here),
                        reverse=True):
            if self._fits(g, need):
                return g
        return None


@st.composite
def wide_batches(draw):
    """Longer batches than :func:`batches`, with joins (tasks of no call) and dependencies
    many calls share (a trainer's task every rank waits for) or on tasks of an earlier
    batch (any hashable), so that a device has many tasks open and a task many waiters."""
    n = draw(st.integers(1, 60))
    out = []
    for i in range(n):
        deps = draw(st.sets(st.one_of(st.integers(0, i - 1), st.sampled_from(("x", "y"))),
                            max_size=5)) if i else set()
        out.append((draw(st.integers(0, 3)), draw(st.integers(0, 1)), draw(st.integers(0, 2)),
                    draw(st.sampled_from("abc")), deps, draw(st.booleans()),
                    draw(st.integers(0, 3)) == 0, draw(st.integers(0, 7)) == 0))
    return out


@settings(deadline=None)
@given(st.one_of(batches().map(lambda b: [x + (False,) for x in b]), wide_batches()),
       st.booleans())
def test_the_packing_is_the_reference_rules(batch, fused):
    """Call for call the same task as the rule as first written, the same waits."""
    together = (("a", "b"),) if fused else ()
    fast, ref = Packer(together), _Reference(together)
    task: list[int] = []
    for dev, step, chunk, op, deps, collective, elsewhere, join in batch:
        need = {task[d] if isinstance(d, int) else d for d in deps}
        if join:                                          # a task of its own, first
            j = fast.join(need)
            assert ref.new(need) == j
            need = {j}
        if collective and op != "a":                      # a gang's ranks, placed as one
            ranks = tuple((dev + r) % 4 for r in range(1 + chunk))
            gs = fast.gang(ranks, step, need)
            assert gs == [ref.place(d, step, chunk, op, need, need, collective=True)
                          for d in ranks]
            g = gs[0]
        else:
            g = fast.place(dev, step, chunk, op, need, need, collective=collective)
            assert ref.place(dev, step, chunk, op, need, need, collective=collective) == g
        task.append(g)
        if elsewhere:
            fast.read_elsewhere(dev, g, step, chunk, op)
            ref.read_elsewhere(dev, g, step, chunk, op)
    assert fast.waits == ref.waits


def test_a_join_is_a_task_open_to_no_call():
    """A join waits for its inputs in a task of its own (a call's open task holding them
    is not joined), and no call joins it after, even one reading the join alone: the gang
    waiting through the join waits for none of them."""
    pack = Packer()
    a = pack.place(0, step=0, chunk=0, op="a", need=set(), deps=set())
    j = pack.join({a})
    assert j != a and pack.waits[j] == {a}
    assert pack.place(0, step=0, chunk=0, op="b", need={j}, deps={j}) not in (a, j)


@st.composite
def instances(draw):
    """Units at the count's grain, dependencies first: an instance's calls on up to three
    devices at once, a gang's ranks (past ``JOIN_MIN``: through a join), read elsewhere or
    not (a gang: through some of its ranks on its first device)."""
    out = []
    for i in range(draw(st.integers(1, 25))):
        gang = draw(st.integers(0, 3)) == 0
        n = draw(st.sampled_from((1, 2, 3, JOIN_MIN))) if gang else draw(st.integers(1, 3))
        devices = tuple(draw(st.integers(0, 3)) for _ in range(n))
        read = tuple(r for r, d in enumerate(devices) if d == devices[0]) if gang else (0,)
        out.append(Unit(i, devices, draw(st.integers(0, 1)), draw(st.integers(0, 1)),
                        draw(st.sampled_from("abc")),
                        tuple(draw(st.sets(st.integers(0, i - 1), max_size=3)) if i else ()),
                        gang, draw(st.booleans()), read))
    return out


def _calls(units):
    """The same units at the runtime's grain: a call each, a large gang's join first (its
    ranks' one dependency), a rank read elsewhere where it is among those read, a
    non-gang instance's first call alone."""
    for u in units:
        inputs = u.inputs
        if u.gang and len(u.devices) >= JOIN_MIN:
            yield Unit(("join", u.key), (u.devices[0],), u.step, u.chunk, u.op, inputs,
                       join=True)
            inputs = (("join", u.key),)
        for r, d in enumerate(u.devices):
            first = r == (u.read[-1] if u.gang else 0)
            yield Unit(u.key if first else None, (d,), u.step, u.chunk, u.op, inputs, u.gang,
                       u.elsewhere and (r in u.read if u.gang else r == 0))


@settings(deadline=None)
@given(instances(), st.booleans())
def test_an_instance_fed_at_once_packs_as_its_calls_fed_one_by_one(units, fused):
    """What lets the count feed an instance where the runtime feeds a call: the same
    tasks, each waiting for the same, and each unit read through the same task."""
    together = (("a", "b"),) if fused else ()
    at_once, one_by_one = Packer(together), Packer(together)
    a: dict = {}
    b: dict = {}
    at_once.feed(units, a)
    one_by_one.feed(_calls(units), b)
    assert at_once.waits == one_by_one.waits
    assert a == {k: v for k, v in b.items() if not isinstance(k, tuple)}
