"""Conversations priced turn by turn (``rpeg.cost.turns``): what each of their keywords
changes in a step's predicted time, and the plan's printout of it.

The GPU example (pipelines/grpo_qwen7b_tools.rpeg) on h100_64 is priced at a fixed layout,
so each comparison moves one thing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from rpeg.cost.stages import estimate_stage, stage_memory
from rpeg.cost.topology import Topology
from rpeg.cost.turns import makespan, rounds, survival, tool_slots
from rpeg.graph.layout import Layout
from rpeg.graph.work import work_of
from rpeg.spec import load, load_cluster
from rpeg.spec.model import Engine, LengthDist
from rpeg.spec.tools import Latency

PAR = Layout(dp=8)
DEVICES = tuple(range(8))


PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"


@pytest.fixture(scope="module")
def setup():
    p = load(PIPELINES / "grpo_qwen7b_tools.rpeg")
    cluster = load_cluster(PIPELINES / "clusters" / "h100_64.rpeg")
    return p, cluster, work_of(p, "rollout")


def price(work, cluster, engine=Engine.VLLM, partial=0, **conv) -> float:
    if conv:
        work = attrs.evolve(work, conversation=attrs.evolve(work.conversation, **conv))
    return estimate_stage(work, PAR, DEVICES, cluster, engine=engine, partial=partial).time_s


def test_a_queue_of_calls_on_few_cores_takes_waves_and_its_tail():
    assert makespan(0, 4, Latency.fixed(1.0)) == 0.0
    assert makespan(3, 4, Latency.fixed(1.0)) == 1.0
    assert makespan(12, 4, Latency.fixed(1.0)) == 3.0
    tail = Latency.lognormal(1.0, 30.0)
    assert makespan(4, 4, tail) > makespan(4, 4, Latency.fixed(1.0))   # the slowest call


def test_turns_priced_are_the_declared_distribution(setup):
    _, _, work = setup
    alive = survival(work.conversation)            # uniform(min = 1, max = 4)
    assert alive[0] == 1.0 and alive[-1] == 0.0 and all(alive[:-1] >= alive[1:])
    mean = float(work.conversation.turns.quantiles(1024).mean())
    assert abs(float(alive.sum()) - mean) < 1e-9   # a sample takes turn k while alive[k]


def test_more_turns_more_time_and_tool_latency_counts(setup):
    _, cluster, work = setup
    base = price(work, cluster)
    more = price(work, cluster, max_turns=6, turns=LengthDist.fixed(6))
    assert more > base
    slow = attrs.evolve(work, tools=tuple(attrs.evolve(t, latency=Latency.lognormal(4.0, 60.0))
                                          for t in work.tools))
    assert price(slow, cluster) > base


def test_tool_cores_are_what_the_cluster_declares(setup):
    _, cluster, work = setup
    few = attrs.evolve(cluster, tool_cores=8)
    assert tool_slots(few, PAR, work.tools) == 1 and tool_slots(cluster, PAR, work.tools) == 12
    assert price(work, few) > price(work, cluster)
    # fewer cores than replicas on a node: each replica's calls on a share of a core (one
    # core a node was priced as eight, one a replica)
    one, two = attrs.evolve(cluster, tool_cores=1), attrs.evolve(cluster, tool_cores=2)
    assert tool_slots(one, PAR, work.tools) == 1 / 8
    assert price(work, one) > price(work, two) > price(work, few)


def test_a_call_is_priced_no_longer_than_its_timeout(setup):
    """The sandbox kills a call at its tool's timeout: a declared latency past it costs the
    timeout."""
    _, cluster, work = setup
    def tools(timeout, latency):
        return attrs.evolve(work, tools=tuple(attrs.evolve(t, timeout=timeout,
                                                           latency=Latency.fixed(latency))
                                              for t in work.tools))
    assert price(tools(1.0, 20.0), cluster) == pytest.approx(price(tools(1.0, 1.0), cluster))
    assert price(tools(30.0, 20.0), cluster) > price(tools(1.0, 20.0), cluster)


def test_vllm_prefills_only_the_new_context_the_torch_engine_all_of_it(setup):
    _, cluster, work = setup
    topo = Topology.from_cluster(cluster)
    paged, _ = rounds(work, PAR, DEVICES, topo, cluster, work.workload.batch, Engine.VLLM)
    _, torch_gens = rounds(work, PAR, DEVICES, topo, cluster, work.workload.batch,
                           Engine.TORCH)
    _, vllm_gens = rounds(work, PAR, DEVICES, topo, cluster, work.workload.batch, Engine.VLLM)
    assert len(paged) == 4
    # later turns: the torch engine prefills the whole conversation again
    assert torch_gens[0].prefill == pytest.approx(vllm_gens[0].prefill, rel=0.5)
    assert torch_gens[3].prefill > 3 * vllm_gens[3].prefill


def test_carrying_conversations_runs_fewer_rounds_a_step(setup):
    _, cluster, work = setup
    topo = Topology.from_cluster(cluster)
    whole, _ = rounds(work, PAR, DEVICES, topo, cluster, work.workload.batch, Engine.VLLM)
    cap = -(-work.workload.gen_len.max_len // 2)          # carry 1: half the turn budget
    carried, _ = rounds(work, PAR, DEVICES, topo, cluster, work.workload.batch, Engine.VLLM,
                        partial=cap)
    assert (len(whole), len(carried)) == (4, 2)
    assert carried[0].rows > whole[0].rows               # two cohorts a round


@pytest.mark.parametrize("partial", [0, 1024])
def test_conversations_are_handed_on_when_their_round_is_over(setup, partial):
    """A round's ended conversations leave the engine once the round's tool calls ran
    (backends.turns.converse yields them then): the last finish is the stage's time, so the
    simulated op holds its devices as long as its price says, and no sample is handed on
    before its round's tools end."""
    from rpeg.cost.turns import conversation_gen
    _, cluster, work = setup
    topo = Topology.from_cluster(cluster)
    rs, _ = rounds(work, PAR, DEVICES, topo, cluster, work.workload.batch, Engine.VLLM,
                   partial=partial)
    g = conversation_gen(work, PAR, DEVICES, topo, cluster, work.workload.batch,
                         Engine.VLLM, partial=partial)
    ends = [sum(r.generate_s + r.tools_s for r in rs[:k + 1]) for k in range(len(rs))]
    assert g.cost.time_s == pytest.approx(ends[-1])
    assert float(g.finish.max()) == pytest.approx(g.cost.time_s)
    assert all(any(f == pytest.approx(e) for e in ends) for f in set(g.finish.tolist()))
    # what the rounds compute and move is the stage's (its MFU and MBU are not 0)
    _, gens = rounds(work, PAR, DEVICES, topo, cluster, work.workload.batch, Engine.VLLM,
                     partial=partial)
    assert g.cost.roof.flops == pytest.approx(sum(x.cost.roof.flops for x in gens))
    assert g.cost.roof.bytes == pytest.approx(sum(x.cost.roof.bytes for x in gens))
    assert g.cost.roof.flops > 0 and g.cost.roof.bytes > 0


def test_the_kv_cache_holds_whole_conversations(setup):
    _, cluster, work = setup
    one_turn = attrs.evolve(work, conversation=None)
    m_conv = stage_memory(work, PAR, cluster, engine=Engine.VLLM, rows=64).kv_cache
    m_turn = stage_memory(one_turn, PAR, cluster, engine=Engine.VLLM, rows=64).kv_cache
    assert m_conv > m_turn


def test_downstream_ops_work_on_whole_conversations(setup):
    p, _, work = setup
    turn = work.workload.gen_len.mean()
    assert work_of(p, "actor_step").workload.gen_len.mean() > 2 * turn
    assert work_of(p, "actor_step").workload.gen_len.max_len == 8192


def test_compile_prints_each_turns_generation_and_tool_time(pipelines, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "rpeg", "compile", str(pipelines / "tiny_tools.rpeg"),
         "--cluster", str(pipelines / "clusters" / "local_cpu.rpeg"), "--no-gantt",
         "--budget", "50", "-o", str(tmp_path / "plan.json")],
        capture_output=True, text=True, check=True).stdout
    assert "conversations: rollout (up to 2 turns, k)" in out
    head = next(line for line in out.splitlines() if line.strip().startswith("turn"))
    assert head.split() == ["turn", "samples", "generation", "s", "tool", "calls", "tools", "s"]
    assert any(line.strip().startswith("1 ") for line in out.splitlines())


@pytest.mark.parametrize("old, new, faster", [
    ("median = 2 s, max = 30 s", "median = 6 s, max = 30 s", False),
    ("max_turns = 4,", "max_turns = 2,", True)])
def test_diff_prices_a_change_of_turns_or_tool_latency(tmp_path, old, new, faster):
    """``rpeg diff --cluster`` of the GPU example against a copy with fewer turns or a
    slower tool: the change listed, and the predicted step time moved the way it must."""
    spec = PIPELINES / "grpo_qwen7b_tools.rpeg"
    text = spec.read_text()
    if new.startswith("max_turns"):
        text = text.replace("uniform(min = 1, max = 4)", "uniform(min = 1, max = 2)")
    assert old in text
    (tmp_path / "b.rpeg").write_text(text.replace(old, new))
    for name in ("tools.py", "rewards.py", "data"):
        (tmp_path / name).symlink_to(PIPELINES / name)
    done = subprocess.run(
        [sys.executable, "-m", "rpeg", "diff", str(spec), str(tmp_path / "b.rpeg"), "--cluster",
         str(PIPELINES / "clusters" / "h100_64.rpeg"), "--budget", "30"],
        capture_output=True, text=True)
    assert done.returncode == 1, done.stderr                 # 1: the specs differ
    key = "rollout.max_turns: 4 -> 2" if faster else "python.latency: lognormal(median = 2 s"
    assert key in done.stdout
    line = next(x for x in done.stdout.splitlines() if x.strip().startswith("step time:"))
    before, after = (float(x.split()[0]) for x in line.split(":", 1)[1].split("->"))
    assert (after < before) if faster else (after > before), line
