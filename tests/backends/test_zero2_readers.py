"""A ZeRO-2 trainer read in place and trained off-policy, on two real gloo ranks.

FSDP2 at ZeRO-2 keeps its weights whole between train ops, so generation and forward ops on
its devices read them in place, each rank on its own. Two things must then still hold:

* the next train op does not hang: FSDP2 records the order of every forward to prefetch the
  backward's all-gathers by it, and a forward that ran on one rank alone (generation) would
  make that rank prefetch a layer no other rank gathers (``Trained.unsettle`` clears it);
* an off-policy train op (its proximal forward first, behaviour version older than the
  weights) clips and reports the gradient norm: that forward registers the gathered
  parameters, and the norm must be taken over the sharded ones that hold the gradients,
  as registered after the backward (before, it read no gradient at all: 0, no clipping).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.backends.ranks import answers

STEPS = 3


def _rank(rank: int, port: int, q) -> None:
    import torch

    from backends.api import SamplingParams
    from backends.torch_backend import distributed as D
    from backends.torch_backend.generation import TorchEngine
    from backends.torch_backend.modeling import build_model
    from backends.torch_backend.sharding import Trained, TrainLayout
    from backends.torch_backend.train import LossSpec, TokenHeads, train_step
    from rpeg.spec.model import Model, Optimizer
    from rpeg.spec.presets import PRESETS
    from tests.backends.test_sharding import _batch

    torch.set_num_threads(1)
    D.init_world(rank, 2, f"tcp://127.0.0.1:{port}", [(0, 1), (0,), (1,)])
    dims = PRESETS["tiny"]
    model = build_model(dims, heads=("lm",), seed=0)
    members = [Model("actor", "tiny", dims, optimizer=Optimizer("adam", lr=1e-3))]
    trained = Trained.build(model, TokenHeads(model), members, TrainLayout.of((0, 1), zero=2),
                            device="cpu", dtype=torch.float32, master=True, device_index=rank)
    engine = TorchEngine(model)
    norms = []
    for step in range(STEPS):
        if rank == 0:                        # generation on this rank alone, in place
            list(engine.generate([np.array([257, 97])] * 2,
                                 SamplingParams(max_new_tokens=4, seed=step)))
        trained.before_step()
        stats = train_step(trained.heads, trained.optimizer, _batch(),
                           [LossSpec("ppo_clip", clip=0.2)], version=step, minibatches=1,
                           microbatches=1, seed=step, grad_clip=1e-3, rank=rank, world=2)
        trained.after_step()
        norms.append(stats["grad_norm"])
    q.put((rank, norms))
    D.shutdown_world()


def test_a_zero2_trainer_read_in_place_trains_and_clips_off_policy():
    got = dict(answers(_rank, 2, timeout=300))           # a hang guard: the old code hangs
    # step 0 is on-policy (version 0 = behaviour 0); steps 1.. run the proximal forward
    assert got[0] == pytest.approx(got[1])
    assert all(n > 1e-3 for n in got[0]), got          # measured, above the clip: clipped
