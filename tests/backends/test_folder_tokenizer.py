"""A local weights folder with its own tokenizer is read with it; preset models keep bytes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from backends.api import SamplingParams
from backends.torch_backend.executor import Executor
from backends.torch_backend.generation import TorchEngine
from backends.torch_backend.modeling import build_model
from backends.torch_backend.tokenizer import BOS_ID, codec_for, encode
from rpeg.spec.model import OpKind

WORDS = ["<unk>", "<s>", "</s>", "<pad>", "hello", "world", "two", "plus", "is"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny llama and a word-level tokenizer built in code, saved as a transformers folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("weights")
    vocab = {w: i for i, w in enumerate(WORDS)} | {f"w{i}": i for i in range(len(WORDS), 300)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")          # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>", pad_token="<pad>")
    tok.save_pretrained(path)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                         pad_token_id=3)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_folder_tokenizer_is_used(folder, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")             # the folder only, never the hub
    codec = codec_for(str(folder))
    assert codec.encode("hello world") == [4, 5]
    assert codec.prompt("two plus two is", max_len=4) == [1, 7, 6, 8]   # BOS + last 3 tokens
    assert (codec.bos_id, codec.eos_id) == (1, 2)
    assert codec.decode([4, 5, 2]) == "hello world"


def test_presets_and_bare_folders_keep_the_byte_tokenizer(tmp_path):
    codec = codec_for(None)
    assert codec.encode("hi") == encode("hi") == [104, 105] and codec.bos_id == BOS_ID
    assert codec_for(str(tmp_path)).encode("hi") == [104, 105]     # no tokenizer files there


def test_executor_generates_with_the_folder_tokenizer(folder):
    model = SimpleNamespace(weights=str(folder))
    stage = SimpleNamespace(kind=OpKind.GENERATE, target="actor")
    ex = SimpleNamespace(ctx=SimpleNamespace(pipeline=SimpleNamespace(
        stages=(stage,), model=lambda name: model)))
    codec = Executor._codec(ex)
    assert codec.encode("hello") == [4]
    policy = build_model(None, ("lm",), weights=str(folder))
    prompt = np.asarray(codec.prompt("hello world", 8), np.int64)
    chunks = list(TorchEngine(policy).generate(
        [prompt], SamplingParams(max_new_tokens=4, eos_id=codec.eos_id, seed=0)))
    response = chunks[0].response_ids[0]
    assert 1 <= len(response) <= 4 and isinstance(codec.decode(response), str)


def test_missing_weights_folder_is_a_clear_run_error(tmp_path):
    from rpeg.errors import BackendError
    with pytest.raises(BackendError) as e:
        build_model(None, ("lm",), weights=str(tmp_path / "gone"))
    assert "must exist to run" in e.value.message and "folder of the" in e.value.hint
