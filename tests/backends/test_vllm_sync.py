"""Weights into a running vLLM engine through collectives (``backends.vllm_backend.sync``):
after an update the engine's logprobs of a fixed sequence are the trainer's.

The engine runs in a Dask worker (as in a run) and receives while this process, the
trainer's rank 0, sends: a gloo group met over TCP, nothing through Dask. A bf16 trainer
sends two bytes a value; a tensor-parallel engine (two workers) takes each whole tensor
and keeps its shard. Tolerance: |vLLM - torch| <= 1e-4 per token, float32 on both sides
(the torch reference runs the trainer's weights cast to float32, which is what the
engine holds), as in test_vllm_engine.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends.vllm_backend import available

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not available()[0], reason="vllm is not installed")]

TOL = 1e-4


def _spread(model, seed: int, scale: float) -> None:
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=g) * scale).to(p.dtype))


@pytest.mark.parametrize("tp, dtype", [(1, "bfloat16"), (2, "float32")])
def test_engine_weights_after_a_collective_sync_are_the_trainers(tmp_path, tp, dtype):
    import dask
    import torch
    from distributed import Client, LocalCluster

    from backends.api import SamplingParams
    from backends.torch_backend.measure_devices import _free_port
    from backends.torch_backend.modeling import build_model
    from backends.torch_backend.tokenizer import BOS_ID, encode
    from backends.torch_backend.train import forward_arrays
    from backends.vllm_backend import EngineHost, VllmOptions, sync, vllm_dask_config
    from backends.vllm_backend.models import save_policy
    from rpeg.spec.presets import PRESETS

    model = build_model(PRESETS["tiny-vllm"], heads=("lm", "value"), seed=0)
    _spread(model, 1, 0.3)
    path = save_policy(model, tmp_path / "actor")
    _spread(model, 2, 0.3)                       # the trainer moved on: new weights
    trainer = model
    for p in trainer.parameters():              # the parameters in the dtype, buffers as built
        p.data = p.data.to(getattr(torch, dtype))
    with dask.config.set(vllm_dask_config()):
        cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                               resources={"GPU": 1}, dashboard_address=":0")
    client = Client(cluster)
    host = None
    try:
        worker = next(iter(client.scheduler_info()["workers"]))
        host = EngineHost.start(client, path, VllmOptions(dtype="float32", max_model_len=128,
                                                          tensor_parallel=tp,
                                                          cpu_cores="nobind"), worker=worker)
        addr = f"tcp://127.0.0.1:{_free_port()}"
        pending = host.actor.receive_weights(addr, 1, 1 + tp, 1)     # the engine's side
        group = sync.open_group(addr, 0, 1 + tp)
        buckets, sent = sync.send(group, trainer.state_dict(), 256 << 10)
        record = pending.result()
        assert record.version == 1 and record.bytes == sent and record.buckets == buckets > 1
        expected = sum(t.numel() for n, t in trainer.state_dict().items()
                       if not n.startswith("value_head")) * trainer.lm_head.weight.element_size()
        assert expected <= sent < expected + 16 * buckets * 64        # the dtype's bytes
        prompts = [np.array([BOS_ID, *encode(f"sync {i}:")], dtype=np.int64) for i in range(4)]
        (chunk,) = host.generate(prompts, SamplingParams(max_new_tokens=12, seed=3),
                                 min_version=1)
        for p in trainer.parameters():
            p.data = p.data.float()
        reference = forward_arrays(trainer, chunk.prompt_ids, chunk.response_ids, "logprobs")
        ours, ref = np.concatenate(chunk.logprobs), np.concatenate(reference)
        assert np.abs(ours - ref).max() <= TOL
        stale = forward_arrays(build_model(PRESETS["tiny-vllm"], heads=("lm",), seed=0),
                               chunk.prompt_ids, chunk.response_ids, "logprobs")
        assert np.abs(ours - np.concatenate(stale)).max() > 100 * TOL   # the check can fail
    finally:
        if host is not None:
            host.shutdown()
        client.close()
        cluster.close()
