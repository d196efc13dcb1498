"""Every path a spec names is resolved against the folder of the file that wrote it, once,
when the spec is loaded: a base file's datasets, reward module, model folders and histogram
from the base's folder, whichever file extends it and wherever the command runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rpeg.cli import main
from rpeg.errors import Span, SpecError
from rpeg.spec import load
from rpeg.spec.diff import diff
from rpeg.spec.overrides import parse_overrides
from rpeg.spec.paths import FileRef, resolve_written, written_folder

ROOT = Path(__file__).resolve().parents[2]

# the tiny preset's shape, as a transformers config.json says it
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 259,
               "tie_word_embeddings": False, "max_position_embeddings": 512,
               "torch_dtype": "float32"}

BASE = """\
pipeline base_grpo

workload {
    steps      = 2
    prompts    = 4
    samples    = 2
    prompt_len = 8
    gen_len    = empirical("lengths.csv", max = 8)
    dataset    = "data/train.jsonl"
    seed       = 0
}

eval { dataset = "data/test.jsonl"; every = 1; prompts = 2; max_len = 4 }

model actor : hf("models/actor") { optimizer = adam(lr = 3e-3) }
model ref   : tiny { frozen; weights = "models/ref" }
reward mark = python("marks:mark")

stage rollout    = generate(actor, prompts, temperature = 1.0, max_len = 8) -> responses, logprobs
stage ref_lp     = forward(ref, responses) -> ref_logprobs
stage scores     = score(mark, responses)   -> scores
stage adv        = group_norm(scores)      -> advantages
stage actor_step = train(actor, responses, advantages, logprobs, ref_logprobs,
                         loss = grpo(0.2, kl = 0.01), minibatches = 1)
"""

MARKS = """\
from marks_value import VALUE          # a module beside it: imported from the same folder


def mark(prompts, responses, answers=None):
    return [VALUE] * len(responses)
"""

DECOY = "raise RuntimeError('the module beside the variant was imported, not the base\\'s')\n"


def base_and_variant(root: Path, *, models=None) -> tuple[Path, Path]:
    """A base spec in ``root/lib/base`` with everything it names beside it, and a variant in
    ``root/exp/one``: ``extend "../../lib/base/base.rpeg"``, the base two folders away. The
    variant's folder holds decoys of the same names (another dataset, a module that raises
    when imported) that a path resolved against the wrong folder would find. ``models``
    (folder -> None) writes the model folders; by default, a config.json each."""
    base = root / "lib" / "base"
    (base / "data").mkdir(parents=True)
    rows = (ROOT / "pipelines/data/toy.jsonl").read_text().splitlines()
    (base / "data/train.jsonl").write_text("\n".join(rows[:16]) + "\n")
    (base / "data/test.jsonl").write_text("\n".join(rows[16:20]) + "\n")
    (base / "lengths.csv").write_text("2,1\n4,2\n8,1\n")
    (base / "marks.py").write_text(MARKS)
    (base / "marks_value.py").write_text("VALUE = 0.25\n")
    for name in ("actor", "ref"):
        folder = base / "models" / name
        if models is None:
            folder.mkdir(parents=True)
            (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
        else:
            models(folder)
    (base / "base.rpeg").write_text(BASE)
    variant = root / "exp" / "one"
    (variant / "data").mkdir(parents=True)
    (variant / "data/train.jsonl").write_text('{"nothing": "here"}\n')   # no prompt column
    (variant / "marks.py").write_text(DECOY)
    (variant / "marks_value.py").write_text(DECOY)
    (variant / "lengths.csv").write_text("500,1\n")
    spec = variant / "variant.rpeg"
    spec.write_text('extend "../../lib/base/base.rpeg"\npipeline variant\n'
                    "workload { steps = 3 }\n")
    return base, spec


@pytest.fixture
def layout(tmp_path, monkeypatch):
    base, spec = base_and_variant(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)                  # a third folder: neither file's
    return base, spec


def test_a_base_files_paths_resolve_against_the_base_files_folder(layout):
    base, spec = layout
    p = load(spec)
    assert p.workload.dataset == FileRef("data/train.jsonl", str(base / "data/train.jsonl"))
    assert p.workload.dataset.span.path == str(base / "base.rpeg")
    assert p.evaluation.dataset.path == str(base / "data/test.jsonl")
    assert p.model("actor").weights == str(base / "models/actor")
    assert p.model("ref").weights == str(base / "models/ref")
    mark = p.reward("mark")
    assert (mark.source, mark.folder) == (str(base / "marks.py"), str(base))
    assert p.workload.gen_len.max_len == 8 and {b[0] for b in p.workload.gen_len.bins} == \
        {2, 4, 8}                                  # the base's histogram, not the decoy's
    assert p.extends == (str(base / "base.rpeg"),)
    assert p.workload.steps == 3


def test_check_and_compile_read_the_base_files_from_a_third_folder(layout, capsys):
    _, spec = layout
    assert main(["check", str(spec)]) == 0
    out, err = capsys.readouterr()
    assert "warning" not in out + err, out + err
    plan = Path("plan.json")
    assert main(["compile", str(spec), "--cluster",
                 str(ROOT / "pipelines/clusters/local_cpu.rpeg"), "-o", str(plan),
                 "--no-gantt", "--budget", "20"]) == 0
    assert json.loads(plan.read_text())["spec_path"] == str(spec)


def test_the_same_pipeline_loaded_from_its_own_folder_is_equal(layout, monkeypatch):
    base, spec = layout
    far = load(spec)
    monkeypatch.chdir(spec.parent)
    near = load(Path("variant.rpeg"))
    assert near.workload.dataset == far.workload.dataset
    assert near.model("actor").weights == far.model("actor").weights
    assert not diff(far, near).changed


def test_a_command_line_override_is_relative_to_the_current_directory(layout):
    base, spec = layout
    Path("mine.jsonl").write_text((base / "data/train.jsonl").read_text())
    p = load(spec, parse_overrides(['workload.dataset="mine.jsonl"']))
    assert p.workload.dataset.path == str(Path.cwd() / "mine.jsonl")


def test_a_module_only_beside_the_variant_is_not_found_for_the_base(tmp_path, monkeypatch):
    base, spec = base_and_variant(tmp_path)
    (base / "marks.py").unlink()
    monkeypatch.chdir(spec.parent)               # the decoy is in the current directory too
    with pytest.raises(SpecError) as e:
        load(spec)
    assert "reward module 'marks' not found" in e.value.message
    assert str(base) in e.value.hint and e.value.span.path.endswith("base.rpeg")


def test_the_rule_itself():
    span = Span("/exp/a/b.rpeg", 3, 4)
    assert written_folder(span) == Path("/exp/a")
    assert resolve_written("../data/x.jsonl", span) == Path("/exp/data/x.jsonl")
    assert resolve_written("~/x", span) == Path.home() / "x"
    assert written_folder(Span("command line", 1, 1)) == Path.cwd()
    ref = FileRef.written("./data/x.jsonl", span)
    assert ref == FileRef.written("data/x.jsonl", span) and str(ref) == "./data/x.jsonl"
    assert os.fspath(ref) == "/exp/a/data/x.jsonl"


def test_two_specs_naming_one_text_in_two_folders_name_two_files(tmp_path):
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "rewards.py").write_text((ROOT / "pipelines/rewards.py").read_text())
        (folder / "data").symlink_to(ROOT / "pipelines/data")
        (folder / "p.rpeg").write_text((ROOT / "pipelines/tiny_ppo.rpeg").read_text())
    a, b = load(tmp_path / "a/p.rpeg"), load(tmp_path / "b/p.rpeg")
    d = diff(a, b)
    changed = {c.name: (c.before, c.after) for c in d.changes}
    assert changed["dataset"] == (str(tmp_path / "a/data/toy.jsonl"),
                                  str(tmp_path / "b/data/toy.jsonl"))
    assert "toy.source" in changed                  # each spec runs its own rewards.py
