"""The executor with the layouts a plan asks of a train stage, in one process (one device):
offloaded optimizer state survives a checkpoint and a restore, forward ops run packed in
the plan's micro-batches, and a planned ZeRO level builds its layout."""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rpeg.runtime.lowering.context import RunContext  # noqa: E402
from rpeg.runtime.lowering.instances import build_calls  # noqa: E402
from rpeg.runtime.placement import split_plan  # noqa: E402
from rpeg.spec import load  # noqa: E402
from rpeg.spec.model import OpKind  # noqa: E402
from tests.backends.one_process import run_step  # noqa: E402

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"


def _plan(pipeline, **train):
    plan = split_plan(pipeline, 1, staleness=0)
    return attrs.evolve(plan, placements=tuple(
        p.changed(**train) if pipeline.stage(p.stage).kind is OpKind.TRAIN
        else p.changed(packing=True, microbatches=2)
        if pipeline.stage(p.stage).kind is OpKind.FORWARD else p
        for p in plan.placements))


def _moments(opt, clone=False) -> dict:
    params = [p for g in opt.param_groups for p in g["params"]]
    return {(i, k): v.clone() if clone else v for i, p in enumerate(params)
            for k, v in opt.state.get(p, {}).items() if torch.is_tensor(v) and v.dim()}


def test_offloaded_optimizer_state_survives_a_checkpoint_and_a_restore(tmp_path):
    """Regression: a checkpoint read the offloaded (freed) state and the worker crashed."""
    ppo = load(PIPELINES / "tiny_ppo.rpeg")
    ex = run_step(ppo, _plan(ppo, offload=True))
    replica = ex.replicas["actor"]
    assert replica.trained.offload.out               # in host memory between ops
    with replica.trained.state_on_device():
        before = _moments(replica.optimizer, clone=True)
    path = ex.checkpoint("actor", str(tmp_path / "actor"), {"step": 1})
    assert replica.trained.offload.out               # sent out again after the write
    assert ex.restore("actor", path) == replica.version == 1
    replica.trained.before_step()                    # brought in: what the checkpoint held
    after = _moments(replica.optimizer)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k])
                                                 for k in before)


def test_forward_ops_run_packed_in_the_plans_micro_batches():
    """A packed forward in 2 micro-batches gives the log-probabilities of one padded pass."""
    from backends.torch_backend.train import forward_arrays
    ppo = load(PIPELINES / "tiny_ppo.rpeg")
    ex = run_step(ppo, _plan(ppo))
    model = ex.replicas["ref"].model
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, 8) for _ in range(5)]
    responses = [rng.integers(3, 250, n) for n in (3, 9, 1, 6, 4)]
    packed = forward_arrays(model, prompts, responses, "logprobs", microbatches=2, packed=True)
    padded = forward_arrays(model, prompts, responses, "logprobs")
    # float32 summation order only: tokens x (ffn + hidden) x layers terms per value
    d = ppo.model("ref").dims
    tol = sum(8 + len(r) for r in responses) * (d.ffn + d.hidden) * d.layers * 2.0 ** -23
    for a, b in zip(packed, padded, strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("zero", [2, 3])
def test_a_planned_zero_level_on_one_device_runs_fsdp2(zero, tmp_path):
    """ZeRO 2/3 on a world of one rank is FSDP2 (mixed precision, its state handling) as on
    many: it needs a process group of its own, which the context asks for."""
    ppo = load(PIPELINES / "tiny_ppo.rpeg")
    plan = _plan(ppo, zero=zero)
    calls = build_calls(ppo, plan, steps=1)
    ctx = RunContext.create(ppo, plan, calls, run_dir="")
    assert (0,) in ctx.groups and ctx.replicas_collective


def test_a_split_pass_part_is_never_empty():
    """``_part`` divides a batch as ``numpy.array_split`` does, every part holding a
    sequence; a batch smaller than its parts (a plan the placed graph refuses,
    ``rpeg.plan.oplayout.split_parts``) is an error, not an empty part run and priced as
    a full one."""
    from backends.torch_backend.executor import _part
    from rpeg.errors import BackendError
    for n in range(1, 6):
        for size in range(n, 12):
            whole = np.arange(size)
            parts = [_part(whole, i, n) for i in range(n)]
            assert all(len(p) for p in parts)
            assert [list(p) for p in parts] == [list(p) for p in np.array_split(whole, n)]
    with pytest.raises(BackendError, match="split into 3 parts must get at least 3 sequences, "
                                           "not 2"):
        _part(np.arange(2), 2, 3)
