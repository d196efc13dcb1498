"""The workload's data fields, the eval and log blocks and LoRA adapters: checked, printed,
merged by ``extend`` and shown by ``rpeg diff``."""

from __future__ import annotations

from pathlib import Path

import pytest

from rpeg.errors import SpecError
from rpeg.spec import load
from rpeg.spec.diff import diff
from rpeg.spec.parser import parse_text
from rpeg.spec.paths import FileRef
from rpeg.spec.printer import fmt
from rpeg.spec.training import Evaluation, Lora, Template, Tracker

ROOT = Path(__file__).resolve().parents[2]
BASE = (ROOT / "pipelines/tiny_grpo.rpeg").read_text()


def _write(tmp_path: Path, text: str, name: str = "p.rpeg") -> Path:
    (tmp_path / "rewards.py").write_text((ROOT / "pipelines/rewards.py").read_text())
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data/toy.jsonl").write_text('{"prompt": "a"}\n')
    f = tmp_path / name
    f.write_text(text)
    return f


def _with(*lines: str, workload: str = "") -> str:
    text = BASE.replace('    seed       = 0\n', '    seed       = 0\n' + workload)
    return text + "\n".join(lines) + "\n"


def test_data_fields_eval_log_and_lora(tmp_path):
    text = _with('eval { dataset = "data/toy.jsonl"; every = 10; samples = 4; '
                 'temperature = 0.5; prompts = 32 }',
                 'log { trackers = [tensorboard, wandb]; samples = 2; project = "exp" }',
                 workload='    prompt_field = "question"\n    answer_field = "solution"\n'
                          '    template = raw\n')
    text = text.replace("model actor : tiny { optimizer = adam(lr = 3e-3) }",
                        "model actor : tiny { optimizer = adam(lr = 3e-3); "
                        "lora = lora(rank = 4, alpha = 8, targets = [q_proj, v_proj]) }")
    p = load(_write(tmp_path, text))
    w = p.workload
    assert (w.fields.prompt, w.fields.answer, w.template) == ("question", "solution",
                                                               Template.RAW)
    data = FileRef("data/toy.jsonl", str(tmp_path / "data" / "toy.jsonl"))
    assert p.evaluation == Evaluation(data, 10, 4, 0.5, 32, 0, "toy", None)
    assert p.log.trackers == (Tracker.TENSORBOARD, Tracker.WANDB) and p.log.samples == 2
    lora = p.model("actor").lora
    assert lora == Lora(4, 8.0, ("q_proj", "v_proj"))
    # per layer: q (64 -> 64) and v (64 -> 32 kv), rank 4 on both sides
    assert lora.params(p.model("actor").dims) == 2 * 4 * ((64 + 64) + (64 + 32))
    assert fmt(parse_text(fmt(parse_text(text, "p.rpeg")), "p.rpeg")) == \
        fmt(parse_text(text, "p.rpeg"))


def test_defaults_without_the_blocks(tmp_path):
    p = load(_write(tmp_path, BASE))
    assert p.evaluation is None and p.log.trackers == (Tracker.TENSORBOARD,)
    assert p.workload.template is Template.AUTO and p.workload.fields.prompt == "prompt"


@pytest.mark.parametrize("extra,workload,message", [
    ('eval { every = 10 }', "", "the eval block must set dataset"),
    ('eval { dataset = "data/toy.jsonl"; every = 0 }', "", "every must be"),
    ('eval { dataset = "data/toy.jsonl"; every = 5; reward = nope }', "",
     "eval reward must name a reward of the pipeline, not 'nope'"),
    ('eval { dataset = "data/toy.jsonl"; every = 5; sample = 3 }', "", "sample"),
    ('log { trackers = [wandb, neptune] }', "", "tracker must be one of"),
    ('log { trackers = [wandb, wandb] }', "", "tracker wandb is listed twice"),
    ('', '    template = html\n', "template must be one of auto, chat, raw"),
    ('', '    prompt_field = "answer"\n', "prompt_field and answer_field must be different"),
])
def test_errors(tmp_path, extra, workload, message):
    with pytest.raises(SpecError) as info:
        load(_write(tmp_path, _with(extra, workload=workload)))
    assert message in info.value.message, info.value.render()
    assert info.value.span.line > 0


@pytest.mark.parametrize("value,message", [
    ("lora(alpha = 8)", "lora(...) needs rank = N"),
    ("lora(rank = 4, targets = [q_prj])", "a lora target must be one of q_proj"),
    ("lora(rank = 4, targets = [q_proj, q_proj])", "lora target 'q_proj' is listed twice"),
    ("adam(lr = 1)", "lora must be lora(rank = ...)"),
])
def test_lora_errors(tmp_path, value, message):
    text = BASE.replace("model actor : tiny { optimizer = adam(lr = 3e-3) }",
                        f"model actor : tiny {{ optimizer = adam(lr = 3e-3); lora = {value} }}")
    with pytest.raises(SpecError) as info:
        load(_write(tmp_path, text))
    assert message in info.value.message, info.value.render()


def test_a_frozen_model_takes_no_lora(tmp_path):
    text = BASE.replace("model ref   : tiny { frozen }",
                        "model ref   : tiny { frozen; lora = lora(rank = 2) }")
    with pytest.raises(SpecError, match="lora adapts a trained language model"):
        load(_write(tmp_path, text))


def test_extend_merges_eval_keys_and_diff_shows_them(tmp_path):
    base = _write(tmp_path, _with('eval { dataset = "data/toy.jsonl"; every = 10; samples = 4 }'))
    child = _write(tmp_path, 'extend "p.rpeg"\npipeline child\neval { every = 5 }\n'
                             'log { trackers = [mlflow] }\n', "child.rpeg")
    a, b = load(base), load(child)
    assert (b.evaluation.every, b.evaluation.samples) == (5, 4)
    text = diff(a, b).text()
    assert "eval.every: 10 -> 5" in text, text
    assert "log.trackers: tensorboard -> mlflow" in text, text


def test_two_eval_blocks_are_an_error(tmp_path):
    with pytest.raises(SpecError, match="eval"):
        load(_write(tmp_path, _with('eval { dataset = "d"; every = 1 }',
                                    'eval { dataset = "d"; every = 2 }')))
