"""``place STAGE on gpus A..B { ... }``: what a pin means, how it prints, and every way to
get one wrong, with the line:col each error points at."""

from __future__ import annotations

from pathlib import Path

import pytest

from rpeg.errors import SpecError
from rpeg.spec import check_file, load
from rpeg.spec.model import Engine, Pin
from rpeg.spec.parser import parse_text
from rpeg.spec.printer import format_text

# tests/fixtures/small_ppo.rpeg: 13 lines, stages rollout (7) .. critic_step (13); its
# models are `tiny` (4 heads, 2 KV heads, 2 layers). Appended lines start at 14.
BASE = (Path(__file__).resolve().parents[1] / "fixtures" / "small_ppo.rpeg").read_text()
REWARDS = "def score(prompts, responses, answers=None):\n    return [0.0] * len(responses)\n"


def _write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "rewards.py").write_text(REWARDS)
    path = tmp_path / "p.rpeg"
    path.write_text(text)
    return path


def _pins(tmp_path, *lines) -> tuple[Pin, ...]:
    return load(_write(tmp_path, BASE + "".join(x + "\n" for x in lines))).place


def test_a_pin_holds_its_devices_and_the_keys_it_names(tmp_path):
    train, gen, host = _pins(
        tmp_path,
        "place actor_step on gpus 0..3 { dp = 2; tp = 2; pp = 1; zero = 3; recompute; "
        "offload = false; microbatches = 4 }",
        "place rollout on gpus 4..5 { engine = torch; chunks = 2 }",
        "place adv on gpus 0..0")
    assert (train.first, train.last, train.size) == (0, 3, 4)
    assert train.pinned() == (("dp", 2), ("tp", 2), ("pp", 1), ("zero", 3),
                              ("recompute", True), ("offload", False), ("microbatches", 4))
    assert gen.pinned() == (("engine", Engine.TORCH), ("chunks", 2))
    assert host.pinned() == () and host.devices == (0,)
    assert (train.span_of("zero").line, train.span_of("zero").col) == (14, 57)


def test_the_normative_pin_prints_and_reparses_to_itself():
    text = ("pipeline p\nplace actor_step on gpus 0..1 { dp = 2; tp = 1; pp = 1; zero = 3; "
            "recompute; offload; microbatches = 4 }\nplace rollout on gpus 2..3 { engine = vllm;"
            " chunks = 2 }\n")
    once = format_text(text, "x.rpeg")
    assert format_text(once, "x.rpeg") == once
    assert parse_text(once, "x.rpeg").items == parse_text(text, "x.rpeg").items
    assert "place rollout on gpus 2..3 { engine = vllm; chunks = 2 }" in once
    assert "    zero         = 3\n" in once and "    recompute\n" in once


def test_a_pin_without_a_block_is_what_it_was():
    text = "pipeline p\nplace rollout on gpus 0..3\n"
    assert format_text(text, "x.rpeg") == text


# (id, appended line, line, col, message substring)
CASES = [
    ("unknown-key", "place actor_step on gpus 0..1 { dq = 2 }", 14, 33,
     "must be pinned with one of dp, tp, pp, cp, ep, microbatches, zero, packing, "
     "param_offload, engine, recompute, offload, not 'dq'"),
    ("key-of-another-kind", "place rollout on gpus 0..1 { recompute }", 14, 30,
     "layout of generate stage 'rollout' must be pinned with one of dp, tp, pp, zero, "
     "param_offload, engine, chunks"),
    ("host-stage-layout", "place adv on gpus 0..1 { dp = 2 }", 14, 26,
     "may pin only the devices of a stage that runs on the host"),
    ("degrees-not-the-devices", "place actor_step on gpus 0..3 { dp = 2; tp = 1; pp = 1 }", 14,
     49, "dp x tp x pp must be the 4 GPUs of 0..3, not dp = 2 x tp = 1 x pp = 1 = 2"),
    ("degrees-not-dividing", "place actor_step on gpus 0..3 { tp = 3 }", 14, 33,
     "tp = 3 must divide the 4 GPUs of 0..3"),
    ("tp-not-dividing-heads", "place actor_step on gpus 0..2 { tp = 3 }", 14, 33,
     "tp must divide the 4 attention heads of model 'actor', not 3"),
    ("pp-over-layers", "place actor_step on gpus 0..3 { pp = 4 }", 14, 33,
     "pp must be at most the 2 layers of model 'actor', not 4"),
    ("fewer-microbatches-than-stages",
     "place actor_step on gpus 0..1 { pp = 2; microbatches = 1 }", 14, 41,
     "microbatches must be at least pp = 2"),
    ("zero-out-of-range", "place actor_step on gpus 0..1 { zero = 4 }", 14, 40,
     "zero must be at most 3, not 4"),
    ("flag-not-boolean", "place actor_step on gpus 0..1 { recompute = yes }", 14, 45,
     "recompute must be one of true, false, not 'yes'"),
    ("degree-as-flag", "place actor_step on gpus 0..1 { dp }", 14, 33,
     "dp must be set with 'dp = VALUE'"),
    ("unknown-engine", "place rollout on gpus 0..1 { engine = sglang }", 14, 39,
     "engine must be one of auto, torch, vllm, hf, hybrid, not 'sglang'"),
    ("train-engine-on-a-generate", "place rollout on gpus 0..1 { engine = megatron }", 14, 39,
     "engine must be one of auto, torch, vllm, hf, hybrid, not 'megatron'"),
    ("ep-without-experts", "place actor_step on gpus 0..1 { ep = 2 }", 14, 33,
     "ep must be 1 for model 'actor', which has no experts, not 2"),
    ("kv-fraction-over-one", "place rollout on gpus 0..1 { kv_fraction = 1.5 }", 14, 44,
     "kv_fraction must be at most 1, not 1.5"),
    ("cp-not-dividing", "place actor_step on gpus 0..3 { cp = 3 }", 14, 33,
     "cp = 3 must divide the 4 GPUs of 0..3"),
    ("twice", "place actor_step on gpus 0..1 { dp = 2; dp = 2 }", 14, 41,
     "key 'dp' is defined twice"),
    ("unknown-stage", "place actr_step on gpus 0..1 { dp = 2 }", 14, 7,
     "place names unknown stage 'actr_step'"),
    ("engine-against-the-stage",
     None, 14, 30, "must use the engine its stage asks for (torch), not vllm"),
]


@pytest.mark.parametrize(("line_text", "line", "col", "message"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_an_impossible_pin_is_refused_where_it_is_written(tmp_path, line_text, line, col,
                                                         message):
    text = BASE + (line_text or "place rollout on gpus 0..1 { engine = vllm }") + "\n"
    if line_text is None:
        text = text.replace("generate(actor, prompts)", "generate(actor, prompts, "
                            "engine = torch)")
    with pytest.raises(SpecError) as info:
        check_file(_write(tmp_path, text))
    err = info.value
    assert message in err.message, err.render()
    assert (err.span.line, err.span.col) == (line, col), err.render()
    assert err.render().startswith(f"{err.span.path}:{line}:{col}: error: ")
