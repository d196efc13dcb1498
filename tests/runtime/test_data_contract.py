"""The data contract: a verl-layout dataset and reward run as they are; what cannot work is
refused by ``rpeg check`` at the spec's FILE:LINE:COL, before any worker starts, and a bad
row past the first ones stops the run at it.

verl's layout: a Parquet file with a chat-message ``prompt``, ``data_source``, ``ability``,
``reward_model.ground_truth`` and ``extra_info``, scored by ``compute_score(data_source,
solution_str, ground_truth, extra_info)`` once a response.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rpeg.cli import main
from rpeg.errors import RuntimeFailure
from rpeg.runtime.calibrate.inline import run_inline
from rpeg.runtime.datacheck import check_data
from rpeg.runtime.placement import split_plan
from rpeg.spec import load
from tests.conftest import save_chat_model

ROOT = Path(__file__).resolve().parents[2]
VERL_REWARD = '''\
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature: 1 when the response starts with the answer's letter."""
    assert data_source == "toy" and extra_info["split"] == "train"
    return {"score": float(solution_str[:1] == ground_truth[:1]), "acc": 0.0}


def flaky(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] % 2:
        raise ValueError("no verdict for this one")
    return 1.0
'''
SPEC = """\
pipeline verl_layout
workload {{
    steps = 2; prompts = 4; samples = 2; prompt_len = 32; gen_len = 8
    dataset = "data/train.parquet"
    prompt_field = "prompt"
    answer_field = "reward_model.ground_truth"
    seed = 0{extra}
}}
model actor : tiny {{ weights = "chat"; optimizer = adam(lr = 1e-3) }}
model ref : tiny {{ weights = "chat"; frozen }}
reward verl = python("verl_reward:{reward}")
stage rollout = generate(actor, prompts) -> responses, logprobs
stage ref_lp = forward(ref, responses) -> ref_logprobs
stage scores = score(verl, responses) -> scores
stage adv = group_norm(scores) -> advantages
stage actor_step = train(actor, responses, advantages, logprobs, ref_logprobs, loss = grpo(0.2))
"""
SPEC_LINE = {"prompt_field": 5, "answer_field": 6, "prompt_len": 3, "reward": 11}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder as a verl user has it: the parquet, the reward module, a chat model."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    d = tmp_path_factory.mktemp("verl")
    (d / "data").mkdir()
    rows = [json.loads(x) for x in (ROOT / "pipelines/data/toy.jsonl").read_text().splitlines()]
    table = [{"data_source": "toy",
              "prompt": [{"role": "user", "content": r["prompt"]}],
              "ability": "repeat",
              "reward_model": {"style": "rule", "ground_truth": r["answer"]},
              "extra_info": {"split": "train", "index": i}} for i, r in enumerate(rows)]
    pq.write_table(pa.Table.from_pylist(table), d / "data/train.parquet")
    (d / "verl_reward.py").write_text(VERL_REWARD)
    save_chat_model(d / "chat")
    return d


def _spec(folder: Path, name: str = "verl.rpeg", *, extra: str = "",
          reward: str = "compute_score", edit=lambda t: t) -> Path:
    path = folder / name
    path.write_text(edit(SPEC.format(extra=extra, reward=reward)))
    return path


def test_a_verl_layout_dataset_and_reward_run_as_they_are(folder):
    spec = _spec(folder)
    assert main(["check", str(spec)]) == 0
    pipeline = load(spec)
    check_data(pipeline)
    rows = run_inline(pipeline, split_plan(pipeline, 1, staleness=0), steps=2)
    assert len(rows) == 2 and all(0.0 <= r["reward"] <= 1.0 for r in rows)


def test_on_error_zero_scores_a_failing_response_0_and_counts_it(folder):
    spec = _spec(folder, "flaky.rpeg", reward="flaky",
                 edit=lambda t: t.replace('python("verl_reward:flaky")',
                                          'python("verl_reward:flaky", on_error = zero)'))
    pipeline = load(spec)
    rows = run_inline(pipeline, split_plan(pipeline, 1, staleness=0), steps=1)
    assert rows[0]["reward_errors.scores"] > 0 and 0.0 < rows[0]["reward"] < 1.0
    stopping = load(_spec(folder, "flaky_stop.rpeg", reward="flaky"))
    with pytest.raises(RuntimeFailure) as err:
        run_inline(stopping, split_plan(stopping, 1, staleness=0), steps=1)
    text = err.value.render()
    assert "raised ValueError at step 0: no verdict for this one" in text
    assert "verl_reward.py" in text and "in flaky: ValueError raised here" in text


def test_the_layouts_users_bring_are_not_scored_against_empty_answers(folder, capsys):
    """verl's parquet (answers in reward_model.ground_truth) and OpenRLHF's JSON lines
    (answers in label) read with answer_field unset: every reward call would get "" as
    the answer and the run would train on rewards of 0; the checker refuses it at the
    dataset, naming the column that holds them."""
    verl = _spec(folder, "no_answer_field.rpeg",
                 edit=lambda t: t.replace('    answer_field = "reward_model.ground_truth"\n', ""))
    rows = [json.loads(x) for x in (ROOT / "pipelines/data/toy.jsonl").read_text().splitlines()]
    (folder / "data" / "orl.jsonl").write_text(
        "".join(json.dumps({"input": r["prompt"], "label": r["answer"]}) + "\n" for r in rows))
    (folder / "orl_reward.py").write_text(
        "def score(prompts, responses, answers):\n    return [0.0] * len(responses)\n")
    orl = _spec(folder, "orl.rpeg", edit=lambda t: t.replace(
        "verl_reward:compute_score", "orl_reward:score").replace(
        '    answer_field = "reward_model.ground_truth"\n', "").replace(
        'dataset = "data/train.parquet"', 'dataset = "data/orl.jsonl"').replace(
        'prompt_field = "prompt"', 'prompt_field = "input"'))
    for spec, column in ((verl, "reward_model.ground_truth"), (orl, "label")):
        assert main(["check", str(spec)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"{spec}:4:"), err
        assert f"its '{column}' holds answers" in err and \
            f'hint: set answer_field = "{column}" in the workload' in err, err


def test_a_reward_gets_each_answer_as_the_row_holds_it():
    """Text as it is, a number as its text, several answers as their list, and "" where the
    row has none (absent or null), never the text 'None'."""
    from rpeg.runtime.data import answer_of
    rows = [{"answer": "a"}, {"answer": 42}, {"answer": ["a", "A"]}, {"answer": None}, {}]
    assert [answer_of(r) for r in rows] == ["a", "42", ["a", "A"], "", ""]


@pytest.mark.parametrize(("key", "edit", "message", "hint"), [
    ("prompt_field", ('prompt_field = "prompt"', 'prompt_field = "question"'),
     "prompt_field 'question' must name a column, and the row has ability, data_source, "
     "extra_info, prompt, reward_model", None),
    ("answer_field", ("reward_model.ground_truth", "reward_model.ground_truht"),
     "answer_field 'reward_model.ground_truht' must name a column, and its 'reward_model' "
     "holds ground_truth, style", "did you mean 'ground_truth'?"),
    ("prompt_len", ("prompt_len = 32", "prompt_len = 4"),
     "the prompt is 7 tokens, and prompt_len is 4 (truncation = error)", "truncation = left"),
    ("reward", ("verl_reward:compute_score", "verl_reward:missing_column"),
     "takes 'difficulty' by name, which must be a column of the dataset 'data/train.parquet'",
     None),
])
def test_a_broken_contract_is_said_at_the_spec_line_before_anything_runs(
        folder, capsys, key, edit, message, hint):
    (folder / "verl_reward.py").write_text(
        VERL_REWARD + "\n\ndef missing_column(data_source, solution_str, ground_truth, "
                      "difficulty):\n    return 0.0\n")
    spec = _spec(folder, f"{key}.rpeg", edit=lambda t: t.replace(*edit))
    assert main(["check", str(spec)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{spec}:{SPEC_LINE[key]}:"), err
    assert "row 1: " in err or key == "reward"
    assert message in " ".join(err.split()), err
    if hint:
        assert hint in err


def test_chat_prompts_without_a_chat_template_are_refused(folder, capsys):
    """The tiny preset without weights: rpeg's byte tokenizer, which has no chat template."""
    spec = _spec(folder, "bytes.rpeg", edit=lambda t: t.replace('weights = "chat"; ', ""))
    assert main(["check", str(spec)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{spec}:4:") and "row 1: a prompt given as chat messages needs " \
        "the chat template" in err, err


@pytest.mark.parametrize(("truncation", "kept"), [("left", "end"), ("right", "start")])
def test_truncation_cuts_a_long_prompt_where_the_workload_says(folder, truncation, kept):
    from backends.torch_backend.tokenizer import codec_for
    from rpeg.spec.training import Template, Truncation
    codec = codec_for(str(folder / "chat"))
    chat = [{"role": "user", "content": "a*12="}]
    full = codec.prompt(chat, 100, Template.AUTO, Truncation.ERROR)
    cut = codec.prompt(chat, 4, Template.AUTO, Truncation(truncation))
    assert cut == (full[-4:] if kept == "end" else full[:4])
    pipeline = load(_spec(folder, f"{truncation}.rpeg", extra=f"; truncation = {truncation}",
                          edit=lambda t: t.replace("prompt_len = 32", "prompt_len = 4")))
    check_data(pipeline)                   # cut as declared: nothing to refuse


def test_a_bad_row_past_the_first_ones_stops_the_run_at_it(tmp_path):
    """Row 80 of a JSON-lines file lacks the prompt column: the first rows pass the check,
    reading the whole dataset (as a run does before its workers start) names that row."""
    from rpeg.runtime.data import read_rows
    from rpeg.spec.training import Fields
    rows = [{"prompt": f"a*{i % 9 + 1}=", "answer": "a"} for i in range(100)]
    rows[79] = {"question": "a*2=", "answer": "aa"}
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RuntimeFailure) as err:
        read_rows(data, Fields())
    assert f"{data}:80: prompt_field 'prompt' must name a column" in err.value.message


def test_a_prompt_over_prompt_len_at_run_time_names_its_file_and_row(folder):
    """A row the first-rows check did not read: the executor refuses its prompt before
    anything is generated from it."""
    from backends.torch_backend.rows import row_prompt
    from backends.torch_backend.tokenizer import codec_for
    from rpeg.runtime.data import read_rows
    pipeline = load(_spec(folder, "late.rpeg",
                          edit=lambda t: t.replace("prompt_len = 32", "prompt_len = 6")))
    w = pipeline.workload
    rows = read_rows(folder / "data/train.parquet", w.fields)
    codec = codec_for(str(folder / "chat"))
    long = next(r for r in rows if len(r["prompt"][0]["content"]) > 4)   # a*10=: 7 tokens
    with pytest.raises(RuntimeFailure) as err:
        row_prompt(codec, long, w)
    assert err.value.message.startswith(f"{folder / 'data/train.parquet'}:") and \
        "tokens, and prompt_len is 6" in err.value.message
    assert err.value.span.line == 3                     # prompt_len's


def test_the_check_reads_a_saved_dataset_with_pyarrow_alone(tmp_path):
    """datasets' save_to_disk folder: its first Arrow batch, no datasets import."""
    from datasets import Dataset, DatasetDict

    from rpeg.runtime.data import first_rows
    rows = [{"prompt": "a*1=", "answer": "a"}, {"prompt": "a*2=", "answer": "aa"}]
    DatasetDict({"train": Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    assert [r for _, r in first_rows(tmp_path / "saved", "train", 1)] == rows[:1]
    with pytest.raises(RuntimeFailure, match="holds the splits train"):
        first_rows(tmp_path / "saved", None, 1)
    shutil.rmtree(tmp_path / "saved")
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))   # one split: none to pick
    assert [r for _, r in first_rows(tmp_path / "one", None, 2)] == rows
    with pytest.raises(RuntimeFailure, match="holds one split, so split must not be set"):
        first_rows(tmp_path / "one", "test", 1)                    # as the run refuses it


def test_the_check_refuses_an_empty_dataset_as_the_run_does(tmp_path, capsys):
    shutil.copytree(ROOT / "pipelines", tmp_path / "p")
    (tmp_path / "p" / "data" / "toy.jsonl").write_text("")
    assert main(["check", str(tmp_path / "p" / "tiny_grpo.rpeg")]) == 1
    assert "dataset 'data/toy.jsonl' must hold at least one row, and it is empty" in \
        capsys.readouterr().err


def test_without_the_tokenizer_libraries_the_prompt_lengths_are_a_warning(
        folder, monkeypatch, capsys):
    """The compile-only install (no ``torch`` extra) still checks columns and rewards; the
    prompts' token lengths, which need the model's tokenizer, are said to be unchecked."""
    import rpeg.runtime.datacheck as datacheck
    spec = _spec(folder, "no_tok.rpeg",
                 edit=lambda t: t.replace("prompt_len = 32", "prompt_len = 4"))
    assert main(["check", str(spec)]) == 1                   # with the tokenizer: too long
    capsys.readouterr()
    monkeypatch.setattr(datacheck, "_can_tokenize", lambda: False)
    assert main(["check", str(spec)]) == 0
    err = capsys.readouterr().err
    assert "not checked against prompt_len" in err and "rpeg[torch]" in err
    broken = _spec(folder, "no_tok_col.rpeg",
                   edit=lambda t: t.replace('prompt_field = "prompt"', 'prompt_field = "q"'))
    assert main(["check", str(broken)]) == 1                 # columns still checked
