"""The data contract, checked before launch: a dataset's first rows against the spec.

    >>> check_data(load("pipelines/tiny_grpo.rpeg"))                   # doctest: +SKIP

``rpeg check`` and ``rpeg run`` (before any worker starts) read the first
``CHECK_ROWS`` rows of the workload's dataset and of the eval block's (JSON lines,
Parquet or a saved dataset; a file not there yet is the checker's warning) and check
each as the run will read it:

* every field the workload names is a column, a dotted name a path into nested columns
  (``answer_field = "reward_model.ground_truth"``, verl's layout); the answer column only
  when ``answer_field`` is written;
* the prompt is text or chat messages, and chat messages (or ``template = chat``) have a
  chat template in the generating model's tokenizer;
* the prompt, rendered and tokenized as the run will, fits ``prompt_len`` unless the
  workload says how to cut it (``truncation = left | right``);
* every column a python reward takes by name is there.

Each problem is a SpecError at the workload key it breaks (``prompt_field``,
``prompt_len``, ``template``, the reward's line), naming the file, the row and the field,
with a did-you-mean over the columns. At run time every row read meets the same checks
(``rpeg.runtime.data``, the executor's prompts), so a bad row past the first ones stops
the run at it, before anything is trained on it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rpeg.errors import RpegError, SpecError, SpecWarning, did_you_mean
from rpeg.runtime.data import (
    ANSWER_COLUMNS,
    BadRow,
    answer_required,
    contract_row,
    field,
    first_rows,
)
from rpeg.spec.model import OpKind, Reward, RewardForm

CHECK_ROWS = 64


def check_data(pipeline, limit: int = CHECK_ROWS) -> list[SpecWarning]:
    """SpecError at the first row of the workload's or the eval's dataset that breaks the
    contract (see the module doc); nothing when the datasets are not there yet. Returns
    the checks it could not make: without the tokenizer libraries (the ``torch`` extra, which
    a run needs anyway) the prompts' token lengths are a warning, not checked."""
    skipped: list[SpecWarning] = []
    w = pipeline.workload
    sets = []
    if w.dataset:
        sets.append(("dataset", w.dataset, w.split, w.span_of("dataset"),
                     _rewards(pipeline, eval_only=False)))
    e = pipeline.evaluation
    if e is not None:
        sets.append(("eval dataset", e.dataset, e.split, e.span_of("dataset"),
                     _rewards(pipeline, eval_only=True)))
    codec = None
    for what, ref, split, span, rewards in sets:
        if not ref.exists():
            continue
        rows = first_rows(Path(ref.path), split, limit, span, what)
        if not rows:                         # as the run refuses it (read_rows)
            raise SpecError(f"{what} '{ref.text}' must hold at least one row, and it is "
                            "empty", span)
        first = rows[0][0]
        for n, raw in rows:
            where = f"{what} '{ref.text}' row {n}"
            try:
                row = contract_row(raw, w.fields, answer_required(w))
            except BadRow as bad:
                raise SpecError(f"{where}: {bad.text}",
                                span if bad.key == "dataset" else w.span_of(bad.key),
                                hint=bad.hint) from None
            for reward in rewards:
                _check_columns(reward, raw, f"{what} '{ref.text}'", n)
            if n == first and rewards and "answer_field" not in dict(w.keys):
                _answers_found(raw, w, f"{what} '{ref.text}'", n)
                skipped += _shadowed(raw, rewards, f"{what} '{ref.text}'")
            if codec is None:
                codec = _codec(pipeline) or False
                if codec is False and not _can_tokenize():
                    skipped.append(SpecWarning(
                        f"the prompts of {what} '{ref.text}' are not checked against "
                        f"prompt_len: the tokenizer libraries (tokenizers, transformers) are "
                        f"not installed here", span,
                        hint="pip install 'rpeg[torch]' to check them, as a run will"))
            if codec:
                _check_prompt(codec, row, w, where, span)
    return skipped


def _can_tokenize() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("tokenizers", "transformers"))


def _rewards(pipeline, eval_only: bool) -> list[Reward]:
    """The python rewards that score the workload's responses (or the eval's)."""
    if eval_only:
        names = [pipeline.evaluation.reward]
    else:
        names = [s.target for s in pipeline.stages if s.kind is OpKind.SCORE]
    return [r for r in pipeline.rewards if r.name in names and r.module]


def _check_columns(reward: Reward, raw: dict, dataset: str, n: int) -> None:
    missing = [c for c in reward.columns if c not in raw]
    if missing:
        raise SpecError(f"reward '{reward.name}' ({reward.module}:{reward.function}) takes "
                        f"{', '.join(repr(c) for c in missing)} by name, which must be a column "
                        f"of the {dataset}, and its row {n} has "
                        f"{', '.join(sorted(raw)[:8])}", reward.span,
                        hint=did_you_mean(missing[0], sorted(raw))
                        or f"give {missing[0]} a default in the reward, or add the column")


def _answers_found(raw, workload, dataset: str, n: int) -> None:
    """SpecError where the rows hold no ``answer`` column (``answer_field`` unset) and one
    of the columns that hold answers in the layouts users bring (verl's
    ``reward_model.ground_truth``, OpenRLHF's ``label``, ...): every reward call would get
    "" for its answers, and a run would train on rewards of 0 without a word."""
    if not isinstance(raw, dict) or "answer" in raw:
        return
    for name in ANSWER_COLUMNS:
        try:
            field(raw, name, "answer_field")
        except BadRow:
            continue
        raise SpecError(f"{dataset} row {n} has no 'answer' column (answer_field's default), "
                        f"and its '{name}' holds answers: a reward would get \"\" for every "
                        f"response's answer", workload.span_of("dataset"),
                        hint=f'set answer_field = "{name}" in the workload')


def _shadowed(raw, rewards, dataset: str) -> list[SpecWarning]:
    """A warning for each column a batch reward cannot take by name: one named as the
    lists rpeg passes it (``prompts``, ``responses``, ``answers``)."""
    out = []
    for name in ("prompts", "responses", "answers"):
        if isinstance(raw, dict) and name in raw and any(
                r.form is RewardForm.BATCH for r in rewards):
            out.append(SpecWarning(
                f"column '{name}' of the {dataset} is not passed to the reward by name: the "
                f"reward's own '{name}' argument is rpeg's list", rewards[0].span,
                hint=f'answer_field = "{name}" passes it as the answers' if name == "answers"
                else "rename the column to pass it"))
    return out


def _codec(pipeline):
    """Text <-> token ids of the generating model, as the run's workers build it; None
    while its weights folder is not there (the checker's warning): its tokenizer is not
    known yet."""
    from backends import load
    gen = next((s for s in pipeline.stages if s.kind is OpKind.GENERATE), None)
    weights = pipeline.model(gen.target).weights if gen is not None else None
    if (weights and not Path(weights).is_dir()) or not _can_tokenize():
        return None
    return load("torch", "codec")(weights)


def _check_prompt(codec, row: dict, workload, where: str, span) -> None:
    from backends import load
    too_long = load("torch", "prompt_too_long")
    try:
        codec.prompt(row["prompt"], workload.prompt_len, workload.template,
                     workload.truncation)
    except too_long as e:
        raise SpecError(f"{where}: the prompt is {e.tokens} tokens, and prompt_len is "
                        f"{e.max_len} (truncation = error)", workload.span_of("prompt_len"),
                        hint="raise prompt_len, or set truncation = left (keep the end) or "
                             "right (keep the start) in the workload") from None
    except RpegError as e:
        key = "template" if "template" in dict(workload.keys) else None
        raise SpecError(f"{where}: {e.message}", workload.span_of(key) if key else span,
                        hint=e.hint) from None
