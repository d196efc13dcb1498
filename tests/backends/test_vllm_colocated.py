"""vLLM beside a training replica in one process: started once, synced when the replica moves."""

from __future__ import annotations

import types

import numpy as np
import pytest

from backends.vllm_backend import available

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not available()[0], reason="vllm is not installed")]


@pytest.fixture(params=["alone", "beside_ddp"])
def trainer_group(request):
    """Whether the process is already in a torch.distributed group, as a DDP trainer is."""
    import torch.distributed as dist

    if request.param == "alone":
        yield False
        return
    from backends.torch_backend.measure_devices import _free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)
    try:
        yield True
    finally:
        dist.destroy_process_group()


def test_colocated_engine_follows_the_replica_and_keeps_its_random_stream(trainer_group):
    import torch
    import torch.distributed as dist

    from backends.api import SamplingParams
    from backends.torch_backend.modeling import build_model
    from backends.torch_backend.tokenizer import BOS_ID
    from backends.torch_backend.train import forward_arrays
    from backends.vllm_backend.colocated import colocated_engine, shutdown_colocated
    from rpeg.spec.presets import PRESETS

    model = build_model(PRESETS["tiny-vllm"], heads=("lm",), seed=2)
    replica = types.SimpleNamespace(model=model, version=3)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    engine = colocated_engine(replica)
    try:
        assert torch.equal(torch.rand(3), expected), "starting vLLM must not reseed the host"
        assert engine.version == 3 and not engine.syncs
        assert engine.isolated == trainer_group    # beside a trainer's group: a child process
        params = SamplingParams(max_new_tokens=8, seed=1)
        ps = [np.array([BOS_ID, 65 + i]) for i in range(4)]
        assert next(engine.generate(ps, params)).version == 3

        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1.5)
        replica.version = 4
        assert colocated_engine(replica) is engine and engine.version == 4
        assert [s.version for s in engine.syncs] == [4]
        chunk = next(engine.generate(ps, params))
        ref = forward_arrays(model, chunk.prompt_ids, chunk.response_ids, "logprobs")
        assert np.abs(np.concatenate(chunk.logprobs) - np.concatenate(ref)).max() <= 1e-4
        assert colocated_engine(replica) is engine and len(engine.syncs) == 1   # no needless push
    finally:
        shutdown_colocated(replica)
    assert replica.vllm_engine is None and replica.vllm_workdir is None
    assert dist.is_initialized() == trainer_group  # the trainer's group outlives the engine
