"""Shared fixtures: paths into the repository.

The embedded default's profile is the shipped one in every test (and in every process a
test starts): a test's outcome never depends on a calibration of the machine it runs on,
or on one being cached (tests/runtime/test_machine.py sets its own).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ["RPEG_LOCAL_PROFILE"] = "shipped"


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture
def pipelines() -> Path:
    return ROOT / "pipelines"


def save_reward_model(folder: Path, seed: int = 11) -> Path:
    """A tiny reward model as a sequence-classification checkpoint of one label (what a
    reward model trained elsewhere is saved as): its ``score`` head is what rpeg reads."""
    import torch
    from transformers import LlamaForSequenceClassification

    from backends.torch_backend.modeling import hf_config
    from rpeg.spec.presets import PRESETS
    config = hf_config(PRESETS["tiny"])
    config.num_labels = 1
    torch.manual_seed(seed)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    return folder


@pytest.fixture
def reward_model():
    """``save_reward_model``, for tests that need a reward model's folder."""
    return save_reward_model
