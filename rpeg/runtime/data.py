"""What a run reads: JSON lines, Parquet or a saved Hugging Face dataset, in epochs.

    >>> rows = [{"prompt": str(i)} for i in range(5)]
    >>> [r["prompt"] for r in step_rows(rows, prompts=3, samples=1, seed=0, step=0)]
    ['0', '2', '3']
    >>> [r["prompt"] for r in step_rows(rows, prompts=3, samples=1, seed=0, step=1)]
    ['1', '4', '2']

The dataset is read in a shuffled order, one permutation per epoch seeded by (seed,
epoch), epoch after epoch: step s reads the ``prompts`` rows from position
``s * prompts`` of that endless sequence (above, step 1 ends epoch 0 with rows 1 and 4 and
starts epoch 1). Every worker computes the same rows from the step alone. A resumed run
starts from the :class:`Cursor` its checkpoint recorded (the step and the position
there), so it continues with the next prompt even if it reads more or fewer prompts per
step than before.

Formats, by what the path is: ``*.jsonl`` (one JSON object per line), ``*.parquet``
(read with pyarrow), or a folder written by ``datasets``' ``save_to_disk`` (read with
``load_from_disk``; a ``DatasetDict`` needs the ``split``). Local files only: nothing is
fetched from a hub. The workload's ``prompt_field`` and ``answer_field`` name the
columns; every row becomes ``{"prompt": ..., "answer": ..., <other columns>}``, and the
other columns reach the reward function by name. A prompt is a string, or a list of chat
messages (``{"role": ..., "content": ...}``) for the chat template.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import attrs
import numpy as np

from rpeg.errors import RuntimeFailure, Span, did_you_mean
from rpeg.spec.training import Fields

MAX_JSONL_BYTES = 4 << 30


@attrs.frozen
class Cursor:
    """Where in the endless shuffled sequence of rows step ``step`` starts reading."""

    step: int = 0
    position: int = 0

    def at(self, step: int, prompts: int) -> int:
        """The position step ``step`` starts reading at."""
        return self.position + (step - self.step) * prompts

    def moved_to(self, step: int, prompts: int) -> Cursor:
        return Cursor(step, self.at(step, prompts))

    def to_json(self) -> dict:
        return {"step": self.step, "position": self.position}

    @classmethod
    def from_json(cls, data) -> Cursor:
        if not isinstance(data, dict):
            return cls()
        return cls(int(data.get("step", 0)), int(data.get("position", 0)))


def dataset_path(pipeline) -> Path:
    """The workload's dataset: the absolute path the spec resolved where it named it
    (``rpeg.spec.paths``)."""
    if not pipeline.workload.dataset:
        raise RuntimeFailure("the workload must name a dataset to run, and it names none",
                             pipeline.workload.span, hint='add dataset = "data/toy.jsonl"')
    return Path(pipeline.workload.dataset.path)


def workload_rows(pipeline) -> list[dict]:
    w = pipeline.workload
    return read_rows(dataset_path(pipeline), w.fields, w.split, w.dataset.span,
                     answer_required=answer_required(w))


def eval_rows(pipeline) -> list[dict]:
    """The eval block's held-out rows (its first ``prompts`` of them), in file order."""
    e = pipeline.evaluation
    w = pipeline.workload
    rows = read_rows(Path(e.dataset.path), w.fields, e.split, e.dataset.span, "eval dataset",
                     answer_required=answer_required(w))
    return rows[: e.prompts] if e.prompts else rows


def answer_required(workload) -> bool:
    """Whether every row must hold the answer column: when the workload names it."""
    return "answer_field" in dict(workload.keys)


def read_rows(path: Path, fields: Fields = Fields(), split: str | None = None,
              span: Span | None = None, what: str = "dataset",
              answer_required: bool = False) -> list[dict]:
    """Every row of the dataset at ``path``, as ``{"prompt", "answer", ...}`` dicts."""
    if not path.exists():
        raise RuntimeFailure(f"{what} '{path}' must exist to run, and it does not", span,
                             hint="a path in a spec is relative to the folder of the file "
                                  "that names it")
    if path.is_dir():
        raw = _saved_dataset(path, split, span, what)
    elif path.suffix == ".parquet":
        raw = _parquet(path, what)
    else:
        raw = _jsonl(path, what)
    rows = [_row(r, n, fields, path, answer_required) for n, r in raw]
    if not rows:
        raise RuntimeFailure(f"{what} '{path}' must hold at least one row, and it is empty",
                             span)
    return rows


def _jsonl(path: Path, what: str):
    st = path.stat()
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_JSONL_BYTES:
        raise RuntimeFailure(f"{what} '{path}' must be a regular file of at most "
                             f"{MAX_JSONL_BYTES:,} bytes")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise RuntimeFailure(f"{path}:{n}: each line must be a JSON object, not "
                                 f"{line[:40]!r}") from e
    return out


def _parquet(path: Path, what: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RuntimeFailure(f"{what} '{path}' is Parquet, which needs pyarrow",
                             hint="pip install 'rpeg[data]'") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 — pyarrow raises its own types for a bad file
        raise RuntimeFailure(f"{what} '{path}' must be a Parquet file, and it is not "
                             f"({type(e).__name__}: {e})") from None
    return list(enumerate(table.to_pylist(), 1))


def _saved_dataset(path: Path, split: str | None, span, what: str):
    if not any((path / f).is_file() for f in ("dataset_info.json", "state.json",
                                               "dataset_dict.json")):
        raise RuntimeFailure(f"{what} folder '{path}' must be one written by datasets' "
                             "save_to_disk (state.json or dataset_dict.json), and it is not",
                             span, hint="or name a .jsonl or .parquet file")
    try:
        from datasets import DatasetDict, load_from_disk
    except ImportError:
        raise RuntimeFailure(f"{what} '{path}' is a saved Hugging Face dataset, which needs "
                             "the datasets package", hint="pip install 'rpeg[data]'") from None
    ds = load_from_disk(str(path))
    if isinstance(ds, DatasetDict):
        if split is None or split not in ds:
            raise RuntimeFailure(f"{what} '{path}' holds the splits {', '.join(ds)}; split "
                                 f"must name one of them, not {split!r}", span,
                                 hint='add split = "train" (workload) or split = "test" '
                                      "(eval)")
        ds = ds[split]
    elif split is not None:
        raise RuntimeFailure(f"{what} '{path}' holds one split, so split must not be set "
                             f"(it is {split!r})", span)
    return list(enumerate(ds.to_list(), 1))


ROW = "__row__"          # where a row came from: (file, row number); no reward sees it


class BadRow(Exception):
    """A row that breaks the data contract: ``key`` names the workload key whose text is
    to blame (prompt_field, answer_field, or dataset for the row itself)."""

    def __init__(self, key: str, text: str, hint: str | None = None) -> None:
        super().__init__(text)
        self.key, self.text, self.hint = key, text, hint


def field(raw: dict, name: str, key: str):
    """The value of column ``name`` in a row; a dotted name walks into nested columns
    (``reward_model.ground_truth``, verl's layout). BadRow when a part is missing, with a
    did-you-mean over the columns at that level."""
    value, walked = raw, []
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            where = ".".join(walked)
            have = sorted(value) if isinstance(value, dict) else []
            holds = (f"'{where}' is {type(value).__name__}, not an object" if
                     not isinstance(value, dict) else
                     f"{'its ' + repr(where) + ' holds' if where else 'the row has'} "
                     f"{', '.join(have[:8])}{', ...' if len(have) > 8 else ''}")
            raise BadRow(key, f"{key} '{name}' must name a column, and {holds}",
                         did_you_mean(part, have) if have else None)
        value = value[part]
        walked.append(part)
    return value


def contract_row(raw, fields: Fields, answer_required: bool = True) -> dict:
    """A dataset row as rpeg reads it: ``{"prompt", "answer", <other columns>}``, or BadRow.
    The answer column may be absent when the workload leaves ``answer_field`` unset
    (``answer_required`` False): its rows have no answer."""
    if not isinstance(raw, dict):
        raise BadRow("dataset", f"each row must be an object, not {type(raw).__name__}")
    prompt = field(raw, fields.prompt, "prompt_field")
    if not isinstance(prompt, str) and not _is_messages(prompt):
        raise BadRow("prompt_field", f"prompt '{fields.prompt}' must be text or a list of chat "
                     f"messages ({{\"role\", \"content\"}}), not {type(prompt).__name__}")
    # the prompt and answer columns become "prompt" and "answer"; a nested one's column
    # stays whole, its other fields for the reward
    row = {k: v for k, v in raw.items() if k not in (fields.prompt, fields.answer)}
    row["prompt"] = prompt
    try:
        row["answer"] = field(raw, fields.answer, "answer_field")
    except BadRow:
        if answer_required:
            raise
    return row


def first_rows(path: Path, split: str | None, limit: int, span: Span | None = None,
               what: str = "dataset") -> list[tuple[int, object]]:
    """(row number, raw row) of the first ``limit`` rows, reading no more of the file than
    they take: JSON lines line by line, Parquet's first batch, a saved dataset's first Arrow
    record batch (read with pyarrow: checking imports neither datasets nor torch)."""
    if path.is_dir():
        return _saved_first(path, split, limit, span, what)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        try:
            batch = next(pq.ParquetFile(path).iter_batches(batch_size=limit), None)
        except Exception as e:  # noqa: BLE001 — pyarrow raises its own types for a bad file
            raise RuntimeFailure(f"{what} '{path}' must be a Parquet file, and it is not "
                                 f"({type(e).__name__}: {e})", span) from None
        return list(enumerate(batch.to_pylist() if batch is not None else [], 1))
    out = []
    with open(path, encoding="utf-8-sig") as fh:          # a BOM, as Windows tools write
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                out.append((n, json.loads(line)))
            except json.JSONDecodeError:
                raise RuntimeFailure(f"{path}:{n}: each line must be a JSON object, not "
                                     f"{line.strip()[:40]!r}", span) from None
            if len(out) >= limit:
                break
    return out


def _saved_first(path: Path, split: str | None, limit: int, span, what: str):
    import pyarrow as pa
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if split is None or split not in splits:
            raise RuntimeFailure(f"{what} '{path}' holds the splits {', '.join(splits)}; split "
                                 f"must name one of them, not {split!r}", span,
                                 hint='add split = "train" (workload) or split = "test" '
                                      "(eval)")
        path = path / split
    elif split is not None:                  # as the run reads it (_saved_dataset)
        raise RuntimeFailure(f"{what} '{path}' holds one split, so split must not be set "
                             f"(it is {split!r})", span)
    state = path / "state.json"
    if not state.is_file():
        raise RuntimeFailure(f"{what} folder '{path}' must be one written by datasets' "
                             "save_to_disk (state.json or dataset_dict.json), and it is not",
                             span, hint="or name a .jsonl or .parquet file")
    out: list = []
    for f in json.loads(state.read_text()).get("_data_files", []):
        with pa.memory_map(str(path / f["filename"])) as source:
            reader = pa.ipc.open_stream(source)
            for batch in reader:
                out += batch.to_pylist()
                if len(out) >= limit:
                    return list(enumerate(out[:limit], 1))
    return list(enumerate(out, 1))


def _row(raw, n: int, fields: Fields, path: Path, answer_required: bool = False) -> dict:
    try:
        row = contract_row(raw, fields, answer_required)
    except BadRow as e:
        raise RuntimeFailure(f"{path}:{n}: {e.text}", hint=e.hint) from None
    row[ROW] = (str(path), n)
    return row


def _is_messages(v) -> bool:
    return isinstance(v, list) and bool(v) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in v)


def epoch_order(rows: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of ``rows`` that epoch ``epoch`` reads them in."""
    return np.random.default_rng([seed, epoch, 0x5EED]).permutation(rows)


def row_indices(rows: int, start: int, count: int, seed: int) -> list[int]:
    """Indices of the ``count`` rows read from position ``start`` on, epoch after epoch."""
    out: list[int] = []
    pos = start
    while len(out) < count:
        epoch, at = divmod(pos, rows)
        take = min(rows - at, count - len(out))
        out += epoch_order(rows, seed, epoch)[at: at + take].tolist()
        pos += take
    return out


def step_rows(rows: list[dict], prompts: int, samples: int, seed: int, step: int,
              cursor: Cursor = Cursor()) -> list[dict]:
    """The rows of one step, each repeated ``samples`` times (the same on every worker)."""
    idx = row_indices(len(rows), cursor.at(step, prompts), prompts, seed)
    return [rows[i] for i in idx for _ in range(samples)]


def answer_of(row: dict):
    """A row's answer as a reward gets it: the column's text, a number as its text, a list
    or an object as the dataset holds it (several acceptable answers), "" where the row
    has none (the column absent or null), never the text 'None'."""
    value = row.get("answer")
    if value is None:
        return ""
    if isinstance(value, (bool, int, float)):
        return str(value)
    return value


# columns that hold the answers in the layouts users bring (verl, OpenRLHF, TRL, GSM8K...),
# looked for where a workload leaves answer_field unset and its rows have no "answer"
ANSWER_COLUMNS = ("reward_model.ground_truth", "ground_truth", "label", "solution",
                  "target", "answers", "gold", "reference")


def reward_extras(rows: list[dict]) -> dict[str, list]:
    """The columns other than prompt and answer, one list each, for the reward function."""
    keys = dict.fromkeys(k for r in rows for k in r if k not in ("prompt", "answer", ROW))
    return {k: [r.get(k) for r in rows] for k in keys}
