"""Datasets: JSON lines, Parquet and saved Hugging Face datasets, the field map, and the
order prompts are read in (seeded epochs, a cursor a resumed run continues from)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg.errors import RuntimeFailure
from rpeg.runtime.data import ROW, Cursor, read_rows, reward_extras, row_indices, step_rows
from rpeg.spec.training import Fields

ROWS = [{"question": f"q{i}", "solution": str(i), "level": i % 3} for i in range(7)]
FIELDS = Fields("question", "solution")


def _content(rows: list[dict]) -> list[dict]:
    """The rows without where each came from (the file differs, the content is the same)."""
    return [{k: v for k, v in r.items() if k != ROW} for r in rows]


def _jsonl(tmp_path, rows=ROWS):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_jsonl_with_a_field_map(tmp_path):
    rows = read_rows(_jsonl(tmp_path), FIELDS)
    # where the row came from travels with it (file, row number), for a bad row's error
    assert rows[2] == {"prompt": "q2", "answer": "2", "level": 2,
                       ROW: (str(tmp_path / "d.jsonl"), 3)}
    assert reward_extras(rows[:3]) == {"level": [0, 1, 2]}


def test_a_byte_order_mark_is_read_past(tmp_path):
    """JSON lines saved by a Windows editor start with a UTF-8 byte order mark: the same
    rows, by the run's reader and the checker's."""
    from rpeg.runtime.data import first_rows
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + _jsonl(tmp_path).read_bytes())
    assert _content(read_rows(p, FIELDS)) == _content(read_rows(_jsonl(tmp_path), FIELDS))
    assert first_rows(p, None, 1) == [(1, ROWS[0])]


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None,
                    reason="pyarrow is not installed (pip install 'rpeg[data]')")
def test_parquet_reads_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert _content(read_rows(path, FIELDS)) == _content(read_rows(_jsonl(tmp_path), FIELDS))


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None,
                    reason="datasets is not installed (pip install 'rpeg[data]')")
def test_a_saved_dataset_and_its_splits(tmp_path):
    from datasets import Dataset, DatasetDict
    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert _content(read_rows(tmp_path / "one", FIELDS)) == \
        _content(read_rows(_jsonl(tmp_path), FIELDS))
    DatasetDict({"train": Dataset.from_list(ROWS[:5]),
                 "test": Dataset.from_list(ROWS[5:])}).save_to_disk(str(tmp_path / "two"))
    assert [r["prompt"] for r in read_rows(tmp_path / "two", FIELDS, "test")] == ["q5", "q6"]
    with pytest.raises(RuntimeFailure, match="holds the splits train, test; split must name "
                                             "one of them, not None"):
        read_rows(tmp_path / "two", FIELDS)


def test_chat_messages_are_prompts_too(tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    rows = read_rows(_jsonl(tmp_path, [{"prompt": msgs, "answer": "4"}]))
    assert rows[0]["prompt"] == msgs


@pytest.mark.parametrize("rows,fields,message", [
    ([{"prompt": "a"}], FIELDS, "prompt_field 'question' must name a column, and the row has "
                                "prompt"),
    ([{"question": 3}], FIELDS, "prompt 'question' must be text or a list of chat messages"),
    ([{"question": [{"role": "user"}]}], FIELDS, "must be text or a list of chat messages"),
    ([], FIELDS, "must hold at least one row"),
])
def test_bad_rows_are_refused(tmp_path, rows, fields, message):
    with pytest.raises(RuntimeFailure, match=message.replace("(", r"\(")):
        read_rows(_jsonl(tmp_path, rows), fields)


def test_a_folder_that_is_not_a_saved_dataset(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(RuntimeFailure, match="must be one written by datasets' save_to_disk"):
        read_rows(tmp_path / "x")


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), prompts=st.integers(1, 50), seed=st.integers(0, 2**31 - 1),
       steps=st.integers(1, 6))
def test_epochs_read_every_row_once_each(rows, prompts, seed, steps):
    """Step after step, each epoch's rows are a permutation: nothing repeats or is skipped
    before the epoch ends."""
    seen = [i for s in range(steps)
            for i in row_indices(rows, s * prompts, prompts, seed)]
    for e in range(len(seen) // rows):
        assert sorted(seen[e * rows:(e + 1) * rows]) == list(range(rows))


@settings(max_examples=40, deadline=None)
@given(cut=st.integers(0, 9), before=st.integers(1, 9), after=st.integers(1, 9),
       seed=st.integers(0, 1000))
def test_a_cursor_continues_with_the_next_prompt(cut, before, after, seed):
    """A run that reads ``before`` prompts a step up to the cut and ``after`` from it on
    reads the same sequence of rows as one reading it all at once."""
    rows = [{"prompt": str(i)} for i in range(11)]
    stream = [r["prompt"] for s in range(cut) for r in step_rows(rows, before, 1, seed, s)]
    cursor = Cursor().moved_to(cut, before)
    stream += [r["prompt"] for s in range(cut, cut + 3)
               for r in step_rows(rows, after, 1, seed, s, cursor)]
    whole = [str(i) for i in row_indices(11, 0, len(stream), seed)]
    assert stream == whole


def test_samples_repeat_each_prompt():
    rows = [{"prompt": str(i)} for i in range(5)]
    got = [r["prompt"] for r in step_rows(rows, 2, 3, 0, 0)]
    assert got[:3] == [got[0]] * 3 and got[3:] == [got[3]] * 3


def test_a_resume_finds_the_files_whose_content_changed(tmp_path):
    """run.json records a fingerprint of each dataset and reward module at the start; a
    resume reads them again and names those that changed (it warns: a fixed reward is a
    reason to resume), and none when they are as they were."""
    import shutil
    from pathlib import Path

    from rpeg.runtime.inputs import changed_since, fingerprints
    from rpeg.spec import load
    root = Path(__file__).resolve().parents[2] / "pipelines"
    shutil.copytree(root, tmp_path / "p")
    pipeline = load(tmp_path / "p" / "tiny_grpo.rpeg")
    at_start = fingerprints(pipeline)
    data = str(tmp_path / "p" / "data" / "toy.jsonl")
    assert set(at_start) == {data, str(tmp_path / "p" / "rewards.py")}
    assert changed_since(at_start, pipeline) == []
    with open(data, "a") as fh:
        fh.write('{"prompt": "z*1=", "answer": "z"}\n')
    assert changed_since(at_start, pipeline) == [data]


def test_a_resume_finds_a_weights_folder_rewritten(tmp_path):
    """A frozen model's weights folder (built from again at every resume) replaced since
    the run started is named, as a changed dataset is."""
    import os
    import shutil
    from pathlib import Path

    from rpeg.runtime.inputs import changed_since, fingerprints
    from rpeg.spec import load
    root = Path(__file__).resolve().parents[2] / "pipelines"
    shutil.copytree(root, tmp_path / "p")
    weights = tmp_path / "p" / "ref_weights"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    (weights / "model.safetensors").write_bytes(b"x" * 64)
    import attrs
    pipeline = load(tmp_path / "p" / "tiny_grpo.rpeg")
    ref = attrs.evolve(pipeline.model("ref"), weights=str(weights))
    pipeline = attrs.evolve(pipeline, models=tuple(ref if m.name == "ref" else m
                                                   for m in pipeline.models))
    at_start = fingerprints(pipeline)
    assert str(weights) in at_start and changed_since(at_start, pipeline) == []
    (weights / "model.safetensors").write_bytes(b"y" * 64)       # the same size, rewritten
    os.utime(weights / "model.safetensors", ns=(1, 1))
    assert changed_since(at_start, pipeline) == [str(weights)]


def test_a_resume_says_the_spec_was_edited(tmp_path, capsys):
    """A resume runs the run's own copy of its spec (spec.rpeg): an edit of the file it
    started from is said, not silently left unread."""
    from types import SimpleNamespace

    from rpeg.runtime.dask.resume import _spec_edited
    (tmp_path / "run").mkdir()
    spec = tmp_path / "p.rpeg"
    spec.write_text("pipeline p\n")
    (tmp_path / "run" / "spec.rpeg").write_text("pipeline p\n")
    rd, meta = SimpleNamespace(path=tmp_path / "run"), SimpleNamespace(spec=str(spec))
    _spec_edited(rd, meta)
    assert capsys.readouterr().err == ""
    spec.write_text("pipeline p  # lr raised\n")
    _spec_edited(rd, meta)
    assert f"{spec} was edited since the run started" in capsys.readouterr().err
