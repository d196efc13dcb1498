"""``rpeg export``: a run's trained actor as a Hugging Face folder that transformers loads,
whose logits are the trained policy's; with LoRA, the adapter folder (PEFT loads it over the
base model) or the merged model; checkpoints without what a resume rebuilds."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from rpeg.cli import main
from rpeg.runtime import RunOptions
from rpeg.runtime.dask.runner import Resilience, run_resilient
from rpeg.runtime.placement import split_plan
from rpeg.spec import load

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"
PROMPT = [257, 97, 42, 98, 61]


def _run(tmp: Path, actor: str, devices: int = 1) -> Path:
    shutil.copy(PIPELINES / "rewards.py", tmp)
    (tmp / "data").mkdir(exist_ok=True)
    shutil.copy(PIPELINES / "data/toy.jsonl", tmp / "data")
    text = (PIPELINES / "tiny_grpo.rpeg").read_text()
    text = text.replace("model actor : tiny { optimizer = adam(lr = 3e-3) }", actor)
    assert actor in text
    (tmp / "p.rpeg").write_text(text)
    pipeline = load(tmp / "p.rpeg")
    plan = split_plan(pipeline, devices, staleness=0)
    return run_resilient(pipeline, plan, RunOptions(steps=2, root=str(tmp / "runs"),
                                                    progress=False),
                         spec_path=str(tmp / "p.rpeg"),
                         resilience=Resilience(checkpoint_every=2)).path


def _policy_logits(run: Path, lora=None) -> torch.Tensor:
    """Logits of the trained actor as the torch backend holds it (rebuilt + checkpoint)."""
    from backends.torch_backend.dcp import weights_of
    from backends.torch_backend.modeling import build_model, load_checkpoint
    from rpeg.runtime.rundir.checkpoints import holds_optimizer
    from rpeg.runtime.rundir.serial import loads
    pipeline = loads((run / "pipeline.json").read_text())
    actor = pipeline.model("actor")
    model = build_model(actor.dims, ("lm",), seed=pipeline.workload.seed)
    if lora is not None:
        from backends.torch_backend.lora import apply_lora
        apply_lora(model, lora, seed=pipeline.workload.seed)
    ck = sorted((run / "checkpoints").glob("step-*"))[-1]
    trained = next(p for p in sorted(ck.glob("actor@*")) if holds_optimizer(p))
    if lora is None:                       # a trained replica's checkpoint: sharded
        model.load_state_dict(weights_of(trained), strict=False)
    else:
        load_checkpoint(model, trained)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        hidden, _ = model(ids, torch.ones_like(ids))
        return model.lm_head(hidden)


def _hf_logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits.float()


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("fp32"),
                "model actor : tiny { optimizer = adam(lr = 3e-3); dtype = fp32 }")


def test_export_loads_with_transformers_and_gives_the_policys_logits(fp32_run, tmp_path,
                                                                     capsys):
    out = tmp_path / "hf"
    assert main(["export", str(fp32_run), "-o", str(out)]) == 0
    assert "exported actor (step 2, version 2)" in capsys.readouterr().out
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "rpeg_export.json"} <= names
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes   # not owner-only
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "float32"
    from safetensors import safe_open
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in keys and "lm_head.weight" in keys
    assert not any(k.startswith(("backbone.", "value_head")) for k in keys)
    # fp32 both ways: the same numbers, up to the two implementations' summation order
    np.testing.assert_allclose(_hf_logits(out), _policy_logits(fp32_run), rtol=0, atol=1e-5)
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(out).encode("hi", add_special_tokens=False) == [104,
                                                                                          105]


def test_bf16_export_holds_the_rounded_weights(fp32_run, tmp_path):
    from safetensors.torch import load_file

    from backends.torch_backend.export import export_run
    pipeline_json = fp32_run / "pipeline.json"
    saved = pipeline_json.read_text()
    try:
        # every model's dtype (a DType; the only enum whose value is fp32)
        pipeline_json.write_text(saved.replace('"value": "fp32"', '"value": "bf16"'))
        got = export_run(fp32_run, tmp_path / "bf16")
    finally:
        pipeline_json.write_text(saved)
    exported = load_file(str(got.path / "model.safetensors"))
    from backends.torch_backend.dcp import weights_of
    ck = sorted((fp32_run / "checkpoints").glob("step-*"))[-1]
    trained = weights_of(ck / "actor@0")
    w = exported["model.layers.1.mlp.up_proj.weight"]
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, trained["backbone.layers.1.mlp.up_proj.weight"].to(torch.bfloat16))


def test_export_errors(fp32_run, tmp_path, capsys):
    assert main(["export", str(fp32_run), "--step", "1", "-o", str(tmp_path / "x")]) == 1
    assert "--step 1 must name a complete checkpoint" in capsys.readouterr().err
    assert main(["export", str(fp32_run), "--model", "ref", "-o", str(tmp_path / "x")]) == 1
    assert main(["export", str(tmp_path), "-o", str(tmp_path / "x")]) == 1
    assert "must be a run directory" in capsys.readouterr().err
    assert main(["export", str(fp32_run), "--merge", "-o", str(tmp_path / "x")]) == 1
    assert "model 'actor' has none" in capsys.readouterr().err


def test_an_export_is_replaced_only_as_rpeg_wrote_it(fp32_run, tmp_path, capsys):
    out = tmp_path / "exp"
    assert main(["export", str(fp32_run), "-o", str(out)]) == 0
    assert main(["export", str(fp32_run), "-o", str(out)]) == 0        # an earlier export
    (out / "NOTES.md").write_text("mine")
    assert main(["export", str(fp32_run), "-o", str(out)]) == 1
    assert "holds files of yours too (NOTES.md)" in capsys.readouterr().err
    assert (out / "NOTES.md").read_text() == "mine"


def test_an_export_never_writes_a_weights_folder_the_run_reads(fp32_run, tmp_path, capsys):
    """A frozen model (or a LoRA model's base) is built from its weights folder again at
    every resume and export: an export over it would change the run."""
    import attrs

    from rpeg.runtime.rundir.serial import dumps, loads
    run = tmp_path / "run"
    shutil.copytree(fp32_run, run)
    base = tmp_path / "base"
    assert main(["export", str(fp32_run), "-o", str(base)]) == 0
    pipeline = loads((run / "pipeline.json").read_text())
    ref = attrs.evolve(pipeline.model("ref"), weights=str(base))
    pipeline = attrs.evolve(pipeline, models=tuple(ref if m.name == "ref" else m
                                                   for m in pipeline.models))
    (run / "pipeline.json").write_text(dumps(pipeline))
    assert main(["export", str(run), "-o", str(base)]) == 1
    assert "a file this command reads" in capsys.readouterr().err


def test_checkpoint_leaves_out_the_frozen_reference(fp32_run):
    ck = sorted((fp32_run / "checkpoints").glob("step-*"))[-1]
    held = {p.name for p in ck.iterdir() if p.is_dir()}
    assert held == {"actor@0", "actor.dcp"}          # its folder and its shards
    assert set(json.loads((ck / "state.json").read_text())["replicas"]) == {"actor@0", "ref@0"}


@pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                    reason="peft is not installed (pip install 'rpeg[lora]')")
def test_lora_run_syncs_adapters_and_exports_them(tmp_path):
    from rpeg.spec.training import Lora
    lora = Lora(4, 8.0, ("q_proj", "v_proj"))
    run = _run(tmp_path, "model actor : tiny { optimizer = adam(lr = 3e-3); dtype = fp32; "
                         "lora = lora(rank = 4, alpha = 8, targets = [q_proj, v_proj]) }",
               devices=2)
    ck = sorted((run / "checkpoints").glob("step-*"))[-1]
    from safetensors.torch import load_file
    held = load_file(str(next(ck.glob("actor@*")) / "model.safetensors"))
    assert held and all(".lora_" in k for k in held)        # the adapters alone
    trace = json.loads((run / "trace.json").read_text())
    assert any(e.get("name", "").startswith("sync_actor") for e in trace["traceEvents"])
    policy = _policy_logits(run, lora)
    merged = tmp_path / "merged"
    assert main(["export", str(run), "--merge", "-o", str(merged)]) == 0
    np.testing.assert_allclose(_hf_logits(merged), policy, rtol=0, atol=1e-5)
    adapter = tmp_path / "adapter"
    assert main(["export", str(run), "-o", str(adapter)]) == 0
    assert (adapter / "adapter_config.json").is_file()
    # the adapter over its base model (the seed's) gives the same logits through PEFT
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from backends.torch_backend.export import hf_state
    from backends.torch_backend.modeling import build_model, hf_config
    from rpeg.runtime.rundir.serial import loads
    pipeline = loads((run / "pipeline.json").read_text())
    dims = pipeline.model("actor").dims
    base = AutoModelForCausalLM.from_config(hf_config(dims))
    own = hf_state(build_model(dims, ("lm",), seed=pipeline.workload.seed).state_dict(), dims)
    base.load_state_dict(own, strict=False)
    with torch.no_grad():
        got = PeftModel.from_pretrained(base, adapter)(torch.tensor([PROMPT])).logits
    np.testing.assert_allclose(got, policy, rtol=0, atol=1e-5)
