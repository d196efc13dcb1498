"""A trained replica under FSDP2 built as its shards: every rank but the first builds the
model as shapes alone (``meta``), the first holds the whole weights in host memory and
sends each rank its shards (``sharding.fill_shards``), on two real gloo ranks.

What it must give: the replica every rank would have had by building the whole model and
sharding it (bit for bit, after a training step), without a rank other than the first
ever holding the whole model. The memory is each process's peak resident set (Linux's
``VmHWM``, reset just before the build) until its shards hold their weights, beside the
same model built whole on every rank, which shows the measurement sees a whole copy
where one is made.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rpeg.cost.calibrate import MALLOC_ENV
from tests.backends.ranks import answers

# Big enough that a whole float32 copy (about 150 MB) stands far above the noise of a
# process's resident set, small enough to build in a second on a CPU; most of it in the
# layers, as in a real model, so that one whole tensor is a small part of it.
DIMS = dict(layers=8, hidden=512, heads=8, kv_heads=8, ffn=2048, vocab=4096)


def _rank(rank: int, port: int, q, mode: str) -> None:
    import attrs
    import torch

    from backends.torch_backend import distributed as D
    from backends.torch_backend import sharding
    from backends.torch_backend.modeling import build_model
    from backends.torch_backend.sharding import Trained, TrainLayout
    from backends.torch_backend.state import gathered
    from backends.torch_backend.train import LossSpec, TokenHeads, train_step
    from rpeg.spec.model import Model, Optimizer
    from rpeg.spec.presets import PRESETS
    from tests.backends.test_sharding import _batch

    torch.set_num_threads(1)
    D.init_world(rank, 2, f"tcp://127.0.0.1:{port}", [(0, 1), (0,), (1,)])
    dims = attrs.evolve(PRESETS["tiny"], **DIMS)
    members = [Model("actor", "tiny", dims, optimizer=Optimizer("adam", lr=1e-3))]
    size = sum(p.numel() for p in build_model(dims, ("lm",), device="meta").parameters()) * 4

    def peak() -> int:
        """The process's peak resident set since it was last reset (Linux's VmHWM)."""
        status = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return int(status["VmHWM"].split()[0]) * 1024

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                # the peak reset to what the process holds now
    before, grown = peak(), []
    if mode == "shards":            # as the runtime builds it (backends.torch_backend.replica)
        model = build_model(dims, ("lm",), seed=0, device="meta")
        whole = build_model(dims, ("lm",), seed=0) if rank == 0 else None
        fill = sharding.fill_shards

        def filled(*args):          # the peak until the shards hold their weights
            fill(*args)
            grown.append(peak() - before)
        sharding.fill_shards = filled
    else:                           # every rank whole, then sharded
        model, whole = build_model(dims, ("lm",), seed=0), None
        grown.append(peak() - before)
    trained = Trained.build(model, TokenHeads(model), members, TrainLayout.of((0, 1), zero=3),
                            device="cpu", dtype=torch.float32, master=True, device_index=rank,
                            whole=whole)
    del whole
    trained.before_step()
    train_step(trained.heads, trained.optimizer, _batch(), [LossSpec("ppo_clip")], version=0,
               minibatches=1, microbatches=1, seed=0, rank=rank, world=2)
    trained.after_step()
    state = {k: v.numpy() for k, v in gathered(trained).items() if "::" not in k}
    q.put((rank, grown[0], size, state if rank == 0 else None))
    D.shutdown_world()


pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(),
                                reason="the peak resident set is reset through Linux's /proc")


@pytest.fixture(scope="module")
def built():
    import os
    # large blocks mapped and unmapped as they are allocated and freed, so that a process's
    # resident set follows the tensors it holds (rpeg.cost.calibrate measures alike)
    saved = dict(os.environ)
    os.environ.update(MALLOC_ENV)
    try:
        return {mode: sorted(answers(_rank, 2, mode, timeout=900), key=lambda a: a[0])
                for mode in ("shards", "whole")}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_a_replica_built_as_shards_trains_as_one_built_whole(built):
    got, want = built["shards"][0][3], built["whole"][0][3]
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_no_rank_but_the_first_holds_the_whole_model(built):
    _, grown, size, _ = built["shards"][1]
    # until its shards hold their weights: the shards (half the weights) and one whole
    # tensor at a time (the largest, 1/20 of the weights here), not the whole model
    assert grown < 0.75 * size, (grown, size)
    _, whole, size, _ = built["whole"][1]
    assert whole >= size, (whole, size)          # the measurement sees a whole copy
