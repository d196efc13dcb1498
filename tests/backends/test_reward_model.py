"""A reward model from its folder: a one-label sequence-classification checkpoint, whose
``score`` head rpeg reads as the reward head (a head nothing trains must come from there;
the checker refuses one that would start at zero)."""

from __future__ import annotations

import numpy as np
import torch

from backends.torch_backend.modeling import build_model
from backends.torch_backend.train import forward_arrays
from rpeg.spec.presets import PRESETS


def test_the_score_head_is_read_from_the_folder(tmp_path, reward_model):
    from transformers import AutoModelForSequenceClassification
    folder = reward_model(tmp_path / "rm")
    model = build_model(PRESETS["tiny"], heads=("value",), weights=str(folder))
    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    assert torch.equal(model.value_head.weight, hf.score.weight)
    prompt, response = np.array([257, 97, 98], np.int64), np.array([99, 100, 101], np.int64)
    scores = forward_arrays(model, (prompt,), (response,), "scores")
    with torch.no_grad():
        want = hf(torch.as_tensor(np.concatenate([prompt, response]))[None]).logits
    assert abs(float(scores[0]) - float(want[0, 0])) < 1e-4 * max(1.0, abs(float(want[0, 0])))
    assert abs(float(scores[0])) > 0.0                   # not the zero head of a fresh model


def test_a_language_model_folder_leaves_the_head_at_zero(tmp_path):
    from transformers import LlamaForCausalLM

    from backends.torch_backend.modeling import hf_config
    LlamaForCausalLM(hf_config(PRESETS["tiny"])).save_pretrained(tmp_path / "lm")
    model = build_model(PRESETS["tiny"], heads=("value",), weights=str(tmp_path / "lm"))
    assert not model.value_head.weight.any()
