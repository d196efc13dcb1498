"""Gradients are reduced in the dtype the cost model prices them at (one rule,
``rpeg.cost.memory.grad_reduce_bytes``): FSDP2's mixed-precision policy on a bf16 model
with float32 master weights reduces in bf16, two bytes a value as ``train_cost`` prices
the reduce-scatter (before, FSDP2 reduced in float32: twice the bytes priced)."""

from __future__ import annotations

import torch

from backends.torch_backend.sharding import Trained, TrainLayout, fsdp_modules, reduce_dtype
from rpeg.cost.examples import ppo_pipeline
from rpeg.cost.memory import grad_reduce_bytes, value_bytes
from rpeg.cost.profiles import cluster_of
from tests.backends.ranks import answers


def _policies(rank: int, port: int, queue) -> None:
    """One gloo rank (a process of its own: a world's store would outlive it in the test's
    process, listening): the reduce and param dtypes of a bf16 trainer's FSDP2 modules."""
    import torch.distributed as dist

    from backends.torch_backend import distributed as D
    from backends.torch_backend.modeling import build_model
    from backends.torch_backend.train import TokenHeads
    from rpeg.spec.model import Model, Optimizer
    from rpeg.spec.presets import PRESETS

    D.init_world(rank, 1, f"tcp://127.0.0.1:{port}", [(0,)])
    try:
        dims = PRESETS["tiny"]
        model = build_model(dims, heads=("lm",), seed=0)
        members = [Model("actor", "tiny", dims, optimizer=Optimizer("adam", lr=1e-3))]
        trained = Trained.build(model, TokenHeads(model), members, TrainLayout.of((0,), zero=2),
                                device="cpu", dtype=torch.bfloat16, master=True,
                                device_index=0)
        policies = {m._get_fsdp_state()._mp_policy for m in fsdp_modules(trained.heads)}
        queue.put(({p.reduce_dtype for p in policies}, {p.param_dtype for p in policies}))
    finally:
        D.shutdown_world()
        assert not dist.is_initialized()


def test_fsdp2_reduces_in_the_bytes_the_cost_model_prices():
    h100 = cluster_of("h100", 8).gpu
    priced = grad_reduce_bytes(value_bytes(ppo_pipeline("llama3.1-8b", prompts=8)
                                           .model("actor"), h100))
    [(reduced, params)] = answers(_policies, 1)
    assert reduced == {reduce_dtype(torch.bfloat16)}
    assert torch.empty((), dtype=reduce_dtype(torch.bfloat16)).element_size() == priced
    assert params == {torch.bfloat16}
