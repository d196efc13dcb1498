"""What a run writes beside its metrics: sampled responses, evaluations, trackers.

    runs/smollm2_gsm-.../
        samples.jsonl    per step, its first ``log.samples`` responses: prompt, response,
                         answer, reward (and each evaluation's, marked "eval": true)
        eval.jsonl       one line per evaluation: step, mean reward, accuracy, pass@k

    >>> rows = read_rows(Path("runs/x"), EVALS)                     # doctest: +SKIP
    >>> rows[-1]["accuracy"]                                        # doctest: +SKIP
    0.43

The step's samples travel in its score ops' statistics and are taken out of the trace
events here (:func:`take_samples`), so the trace stays small. A run rolled back or
resumed to a cut keeps the lines of the steps before it (:func:`cut_back`), like
``metrics.jsonl``; an evaluation at the cut itself stands.
"""

from __future__ import annotations

import json
from pathlib import Path

from rpeg.runtime.rundir.files import open_append, read_bytes, read_metrics, write_atomic

SAMPLES = "samples.jsonl"
EVALS = "eval.jsonl"


def append_rows(run_dir: Path, name: str, rows: list[dict]) -> None:
    if not rows:
        return
    with open_append(Path(run_dir) / name, name) as f:      # never through a symlink
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")


def read_rows(run_dir: Path, name: str) -> list[dict]:
    """The rows of ``name``; a line cut short by a crash is left out, the rest stand."""
    return read_metrics(Path(run_dir), name=name)[0]


def take_samples(step: int, events: list[dict]) -> list[dict]:
    """The step's kept responses, removed from its events' statistics, in response order."""
    rows = []
    for e in events:
        rows += e.get("stats", {}).pop("samples", None) or []
    return [{"step": step, **r} for r in sorted(rows, key=lambda r: r["index"])]


def evaluated(run_dir: Path, step: int) -> bool:
    return any(r.get("step") == step for r in read_rows(run_dir, EVALS))


def cut_back(run_dir: Path, start: int, aside: str | None = None) -> None:
    """Keep the samples of steps before ``start`` and the evaluations up to it; with
    ``aside`` (a resume), the other lines move to ``NAME.<aside>.jsonl``."""
    keep_rows(run_dir, SAMPLES, lambda r: r.get("step", 0) < start
              or (r.get("eval") and r.get("step", 0) <= start), aside)
    keep_rows(run_dir, EVALS, lambda r: r.get("step", 0) <= start, aside)


def keep_rows(run_dir: Path, name: str, keep, aside: str | None = None) -> None:
    """Rewrite the JSON-lines file ``name`` with the rows ``keep`` accepts; with ``aside``,
    every other line (a damaged one too) is written first, as it was, to
    ``STEM.<aside>.jsonl``: nothing is lost."""
    path = Path(run_dir) / name
    if not path.exists():
        return
    kept, dropped = [], []
    for line in read_bytes(path, name).decode("utf-8", "replace").split("\n"):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        ok = isinstance(row, dict) and isinstance(row.get("step"), int) and keep(row)
        (kept if ok else dropped).append(json.dumps(row, sort_keys=True) if ok else line)
    if aside is not None and dropped:
        write_atomic(path.with_name(f"{path.name.split('.')[0]}.{aside}.jsonl"),
                     "".join(x + "\n" for x in dropped))
    write_atomic(path, "".join(x + "\n" for x in kept))


def eval_line(row: dict) -> str:
    """One evaluation in words, for the terminal."""
    parts = [f"reward {row['reward']:.3f}"]
    parts += [f"{k} {row[k]:.3f}" for k in sorted(row) if k == "accuracy" or k.startswith("pass@")]
    return f"eval at step {row['step']}: " + ", ".join(parts) + \
        f" ({row['prompts']} prompts x {row['samples']}, {row.get('eval_s', 0.0):.1f} s)"
