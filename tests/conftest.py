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


def save_chat_model(path: Path, seed: int = 5) -> Path:
    """The tiny model with a tokenizer of its byte vocabulary that has a chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from backends.torch_backend.modeling import hf_config
    from rpeg.spec.presets import PRESETS
    config = hf_config(PRESETS["tiny"])
    vocab = {chr(i) if 33 <= i < 127 else f"<{i}>": i for i in range(config.vocab_size)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<0>", eos_token="<2>",
                                  pad_token="<3>")
    tok.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}>"
    tok.save_pretrained(path)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    return path
