"""Pinned layouts in the planner: honoured by the search and the baselines, refused at the
pin's line:col when the executor planned for does not run them."""

from __future__ import annotations

import attrs
import pytest

from rpeg.errors import PlanError
from rpeg.plan.compile import compile_plan, compile_report
from rpeg.plan.pinned import check_pins
from rpeg.plan.search import SearchOptions
from rpeg.plan.space import Limits
from rpeg.spec import load

from .conftest import ROOT

QUICK = dict(seed=1, iterations=150, patience=100)


def _spec(tmp_path, *pins: str):
    text = (ROOT / "pipelines/tiny_ppo.rpeg").read_text() + "".join(p + "\n" for p in pins)
    (tmp_path / "rewards.py").write_text((ROOT / "pipelines/rewards.py").read_text())
    (tmp_path / "data").mkdir(exist_ok=True)
    path = tmp_path / "pinned.rpeg"
    path.write_text(text)
    return load(path)


def _line_of(pipeline, stage: str) -> int:
    return pipeline.pin(stage).span.line


def test_pinned_layouts_are_what_the_plan_runs(tmp_path, local_cpu):
    pipeline = _spec(tmp_path, "place actor_step on gpus 0..1 { dp = 2; microbatches = 2 }",
                     "place rollout on gpus 1..1 { chunks = 2 }",
                     "place ref_lp on gpus 0..0 { microbatches = 1 }")
    report = compile_report(pipeline, local_cpu, options=SearchOptions(**QUICK))
    train, gen, ref = (report.plan.placement(s) for s in ("actor_step", "rollout", "ref_lp"))
    assert (train.devices, train.dp, train.microbatches) == ((0, 1), 2, 2)
    assert (gen.devices, gen.chunks) == ((1,), 2)
    assert (ref.devices, ref.microbatches) == ((0,), 1)
    for strategy, ev in report.baselines:          # the baselines keep the pins too
        if ev is not None:
            assert ev.plan.placement("actor_step").microbatches == 2, strategy
            assert ev.plan.placement("rollout").devices == (1,), strategy


def test_a_pin_the_runtime_does_not_run_is_refused_at_its_line(tmp_path, local_cpu):
    runtime = Limits.runtime()
    pp = runtime.max_pp + 1
    pipeline = _spec(tmp_path, f"place actor_step on gpus 0..1 {{ dp = 1; pp = {pp} }}")
    with pytest.raises(PlanError) as info:
        compile_plan(pipeline, local_cpu, options=SearchOptions(**QUICK))
    err = info.value
    assert f"pp must be at most {runtime.max_pp} for this executor, not {pp}" in err.message
    assert "pipeline parallelism is not executed" in err.message
    assert (err.span.line, err.span.col) == (_line_of(pipeline, "actor_step"), 41)
    assert "--any-executor" in err.hint
    plan = compile_plan(pipeline, local_cpu, options=SearchOptions(**QUICK, limits=Limits()))
    assert plan.placement("actor_step").pp == pp        # another executor may price it


def test_a_pin_outside_the_cluster_or_wider_than_a_node_is_refused(tmp_path, local_cpu,
                                                                  a100_16):
    pipeline = _spec(tmp_path, "place rollout on gpus 1..2")
    with pytest.raises(PlanError, match="must name GPUs in 0..1, not 1..2") as info:
        compile_plan(pipeline, local_cpu, options=SearchOptions(**QUICK))
    assert info.value.span.line == _line_of(pipeline, "rollout")
    big = tmp_path / "big.rpeg"
    big.write_text((ROOT / "pipelines/ppo_llama8b.rpeg").read_text()
                   + "place rollout on gpus 0..15 { tp = 16 }\n")
    (tmp_path / "rewards.py").write_text((ROOT / "pipelines/rewards.py").read_text())
    with pytest.raises(PlanError, match="tp must stay inside one node of 8 GPUs, not 16"):
        check_pins(load(big), a100_16, attrs.evolve(Limits(), foreign=False))
    check_pins(load(big), a100_16, Limits())    # another system's, priced across the nodes


def test_rpeg_compile_reports_a_refused_pin_as_a_user_error(tmp_path, local_cpu, capsys):
    from rpeg.cli import main
    pipeline = _spec(tmp_path, "place critic_step on gpus 0..1 { zero = 1 }")
    rc = main(["compile", pipeline.path, "--cluster", local_cpu.path, "--no-gantt",
               "-o", str(tmp_path / "p.json"), "--iterations", "50"])
    err = capsys.readouterr().err
    line = _line_of(pipeline, "critic_step")
    if 1 in Limits.runtime().zero:
        assert rc == 0, err
    else:
        assert rc == 1 and err.startswith(f"{pipeline.path}:{line}:34: error: place "
                                          "critic_step: zero must be one of")
        assert "Traceback" not in err and "^" in err


EVAL = 'eval { dataset = "data/toy.jsonl"; every = 2; prompts = 4 }'


def test_the_evaluated_model_is_never_planned_in_pieces(tmp_path, local_cpu):
    """The eval block generates with the actor's trained replica, whole on its first device:
    the planner offers the actor's train stage no ZeRO-3 (nor tp) layout with an eval block,
    and does without one."""
    from rpeg.plan.choices import enumerate_layouts
    runtime = Limits.runtime()
    plain, with_eval = _spec(tmp_path), _spec(tmp_path, EVAL)
    def zeros(pipeline, stage: str = "actor_step") -> set[int]:
        return {lay.par.zero for lay in enumerate_layouts(pipeline, stage, (2,), local_cpu,
                                                          runtime)}
    assert 3 in zeros(plain) and 3 not in zeros(with_eval) and 2 in zeros(with_eval)
    # the critic is not evaluated: its layouts are unchanged
    assert zeros(with_eval, "critic_step") == zeros(plain, "critic_step")


def test_a_pinned_zero3_actor_with_an_eval_block_is_refused_with_a_hint(tmp_path, local_cpu):
    pipeline = _spec(tmp_path, EVAL, "place actor_step on gpus 0..1 { dp = 2; zero = 3 }")
    with pytest.raises(PlanError) as err:
        check_pins(pipeline, local_cpu, Limits.runtime())
    text = err.value.render()
    assert "zero must be one of 0, 2 for train stage 'actor_step' of a pipeline with an " \
           "eval block, not 3" in text
    assert err.value.span.line == _line_of(pipeline, "actor_step") and "pin zero = 2" in text
    check_pins(_spec(tmp_path, EVAL, "place actor_step on gpus 0..1 { dp = 2; zero = 2 }"),
               local_cpu, Limits.runtime())                    # ZeRO-2 keeps it whole
    check_pins(_spec(tmp_path, "place actor_step on gpus 0..1 { dp = 2; zero = 3 }"),
               local_cpu, Limits.runtime())                    # no eval: ZeRO-3 runs


def test_rpeg_check_refuses_the_pin_before_any_plan(tmp_path, capsys):
    from rpeg.cli import main
    _spec(tmp_path, EVAL, "place actor_step on gpus 0..1 { dp = 2; zero = 3 }")
    assert main(["check", str(tmp_path / "pinned.rpeg")]) == 1
    err = capsys.readouterr().err
    assert "pinned.rpeg:" in err and "with an eval block, not 3" in err and "hint: pin zero" in err


GATHERED = ("place values on gpus 0..1 { dp = 2; zero = 3 }",
            "place critic_step on gpus 0..1 { dp = 2; zero = 3 }")


def test_a_zero3_forward_is_run_only_where_it_reads_its_trainers_shards(tmp_path, local_cpu):
    """A forward pinned to ZeRO-3 runs on the torch runtime where every plan keeping the
    pins reads the trainer's shards in place (its trainer's ZeRO-3 GPUs, a step streaming
    one chunk), and is refused at its line elsewhere."""
    runtime = Limits.runtime()
    one = "place rollout on gpus 0..0 { chunks = 1 }"
    plan = compile_plan(_spec(tmp_path, one, *GATHERED), local_cpu,
                        options=SearchOptions(**QUICK))
    assert plan.placement("values").zero == 3
    for pins in ((one.replace("chunks = 1", "chunks = 2"), *GATHERED),      # per chunk
                 GATHERED,                                                 # chunks unpinned
                 (one, GATHERED[0], GATHERED[1].replace("zero = 3", "zero = 2"))):
        pipeline = _spec(tmp_path, *pins)
        with pytest.raises(PlanError) as info:
            check_pins(pipeline, local_cpu, runtime)
        assert "inference on ZeRO-3-sharded weights" in info.value.message
        assert info.value.span.line == _line_of(pipeline, "values")


def test_a_pass_split_over_more_blocks_than_a_step_has_sequences_is_refused(tmp_path,
                                                                             local_cpu):
    """A pass at dp 2 on a batch of one response would give a block an empty part: the
    planner never proposes it (dp <= batch), and a pinned plan asking for it is refused at
    compile time -- its placed graph, the executor's parts and its price would disagree."""
    from rpeg.plan.model import Strategy
    pins = ("place ref_lp on gpus 0..1 { dp = 2 }", "place rollout on gpus 0..0",
            *(f"place {s} on gpus 0..0" for s in ("values", "actor_step", "critic_step")))
    one = _spec(tmp_path, *pins)
    one = attrs.evolve(one, workload=attrs.evolve(one.workload, prompts=1, samples=1))
    with pytest.raises(PlanError, match="stage 'ref_lp' must split a step's 1 sequences over "
                                        "at most 1 parts, not 2") as info:
        compile_plan(one, local_cpu, Strategy.PINNED)
    assert "a part would hold no sequence" in info.value.message
    assert "at most 1 data-parallel blocks" in info.value.hint
    two = attrs.evolve(one, workload=attrs.evolve(one.workload, prompts=2))
    assert compile_plan(two, local_cpu, Strategy.PINNED).placement("ref_lp").dp == 2
