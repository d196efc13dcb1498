"""Whole-pipeline checks that say what cannot work before anything launches.

    >>> check_file("pipelines/tiny_grpo.rpeg")       # doctest: +SKIP

* ``fold_lengths``: a generate stage's ``max_len`` and ``min_len`` bound the responses,
  so the workload's length distribution is capped by them (what the cost model prices
  and what runs); a ``max_len`` above the workload's ``gen_len`` max is refused.
* ``check_context``: the prompt plus the longest response must fit every model that
  reads them.
* ``check_trained``: a model that is not frozen must be trained by some stage.
* ``check_shared_optimizers``: models that may share a backbone share its optimizer, so
  their optimizers may differ only in the learning rate (each head keeps its own).
* the eval block: greedy samples of a prompt are one response (``eval_greedy_samples``),
  its prompts and answers fit the evaluated model (``eval_context``), it evaluates
  within the run (``eval_every``, a warning).

``SECTION_RULES`` are these as rules (``rpeg.spec.rules``): each checked against the
whole pipeline, each with a golden error.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from rpeg.errors import Span, SpecError, SpecWarning
from rpeg.spec import ast
from rpeg.spec.model import Model, OpKind, Stage, Workload
from rpeg.spec.registry import Rule


def _kwarg_span(items, stage: str, key: str) -> Span | None:
    for i in items:
        if isinstance(i, ast.StageDecl) and i.name.value == stage:
            kw = i.call.kwarg(key)
            return kw.span if kw is not None else i.call.span
    return None


def _entry_span(items, key: str) -> Span | None:
    for i in items:
        if isinstance(i, ast.WorkloadDecl):
            for e in i.block.entries:
                if not isinstance(e, ast.Section) and e.key.value == key:
                    return e.span
    return None


def fold_lengths(workload: Workload, stages: tuple[Stage, ...], items) -> Workload:
    gen = [s for s in stages if s.kind is OpKind.GENERATE]
    if not gen:
        return workload
    dist = workload.gen_len
    for s in gen:
        top = s.arg("max_len")
        if top is not None and top > dist.max_len:
            raise SpecError(f"max_len must be at most the workload's gen_len max "
                            f"({dist.max_len}), not {top}", _kwarg_span(items, s.name, "max_len"),
                            notes=_note(items, "gen_len", "gen_len set here"),
                            hint="raise gen_len's max in the workload, or lower max_len")
        low = s.arg("min_len")
        if low is not None and low > (top or dist.max_len):
            raise SpecError(f"min_len must be at most max_len ({top or dist.max_len}), not {low}",
                            _kwarg_span(items, s.name, "min_len"))
    cap = max((s.arg("max_len") or dist.max_len) for s in gen)
    floor = min((s.arg("min_len") or 0) for s in gen)
    return attrs.evolve(workload, gen_len=dist.capped(floor, cap))


def _note(items, key: str, text: str) -> list[tuple[str, Span]]:
    span = _entry_span(items, key)
    return [(text, span)] if span is not None else []


def check_context(workload: Workload, models: tuple[Model, ...], stages, items) -> None:
    """prompt_len + the longest response within every model's context that reads them."""
    from rpeg.spec.tools import conversation
    used = {s.target for s in stages if s.target}
    longest = workload.gen_len.max_len
    for s in stages:        # a conversation: its policy and observation tokens together
        conv = conversation(s, int(s.arg("max_len") or workload.gen_len.max_len)) \
            if s.kind is OpKind.GENERATE else None
        longest = max(longest, conv.max_total_len if conv is not None else 0)
    need = workload.prompt_len + longest
    for m in models:
        if m.name in used and need > m.dims.max_positions:
            raise SpecError(f"prompt_len + the longest response ({workload.prompt_len} + "
                            f"{longest} = {need} tokens) must fit model "
                            f"'{m.name}''s context of {m.dims.max_positions} positions, not "
                            "exceed it", _entry_span(items, "gen_len") or workload.span,
                            notes=[(f"model '{m.name}' ({m.preset}) declared here", m.span)],
                            hint="shorten prompt_len or gen_len's max, or use a model with a "
                                 "longer context")


def check_trained(models: tuple[Model, ...], stages: tuple[Stage, ...], items,
                  versioned: set[str]) -> None:
    """A model with an optimizer that no stage trains: its optimizer state would be held, and
    its weights never change -- almost always a forgotten train stage or 'frozen'."""
    used = {s.target for s in stages if s.target}
    for m in models:
        if m.trainable and m.name in used and m.name not in versioned:
            raise SpecError(f"model '{m.name}' must be trained by a stage or marked frozen; no "
                            "stage trains it", m.span,
                            hint=f"add {{ frozen }} to model '{m.name}', or a stage "
                                 f"train({m.name}, ...)")


def check_shared_optimizers(shares, targets, items) -> None:
    for group in shares:
        members = [targets[n] for n in group if targets[n].optimizer is not None]
        for m in members[1:]:
            a, b = members[0].optimizer, m.optimizer
            differ = [f.name for f in attrs.fields(type(a))
                      if f.name != "lr" and getattr(a, f.name) != getattr(b, f.name)]
            if differ:
                raise SpecError(f"model '{m.name}' may share a backbone with '{members[0].name}', "
                                f"so its optimizer must be the same but for lr, not differ in "
                                f"{', '.join(differ)}", m.span,
                                notes=[(f"'{members[0].name}''s optimizer", members[0].span)],
                                hint="a shared backbone has one optimizer (each head keeps its "
                                     "learning rate): make them agree, or drop the share")




# --- the sections' rules ------------------------------------------------------------------------

def _raised(check):
    def rule(site, _):
        try:
            check(site)
        except SpecError as e:
            return e
        return None
    return rule


def _eval_entry(site, key: str):
    return site.entry(ast.EvalDecl, key)


def _evaluated(site) -> Model | None:
    gen = next((s for s in site.stages if s.kind is OpKind.GENERATE), None)
    return site.model(gen.target) if gen is not None else None


def eval_greedy_samples(site, _) -> SpecError | None:
    e = site.evaluation
    if e is None or e.temperature > 0 or e.samples < 2:
        return None
    return SpecError(f"eval samples must be 1 at temperature 0, not {e.samples}: greedy "
                     f"answers to a prompt are one answer repeated, so pass@{e.samples} would "
                     "be the accuracy", _eval_entry(site, "samples").span,
                     hint="samples = 1, or sample at temperature > 0 for pass@k")


def eval_context(site, _) -> SpecError | None:
    e, model = site.evaluation, _evaluated(site)
    if e is None or model is None or not e.max_len:
        return None
    need = site.workload.prompt_len + e.max_len
    if need <= model.dims.max_positions:
        return None
    return SpecError(f"prompt_len + the eval's max_len ({site.workload.prompt_len} + "
                     f"{e.max_len} = {need} tokens) must fit model '{model.name}''s context "
                     f"of {model.dims.max_positions} positions, not exceed it",
                     _eval_entry(site, "max_len").span,
                     notes=[(f"model '{model.name}' declared here", model.span)],
                     hint=f"max_len = {model.dims.max_positions - site.workload.prompt_len} "
                          "or less")


def eval_every(site, _) -> SpecError | None:
    e, steps = site.evaluation, site.workload.steps
    if e is None or e.every <= steps:
        return None
    return SpecWarning(f"eval every {e.every} steps evaluates only before the first and after "
                       f"the last of the workload's {steps} steps",
                       _eval_entry(site, "every").span)


def checkpoint_every(site, _) -> SpecError | None:
    w = site.workload
    written = "checkpoint_every" in dict(w.keys)      # the default's 10 is no one's mistake
    if not written or not w.checkpoint_every or w.checkpoint_every <= w.steps:
        return None
    return SpecWarning(f"checkpoint_every {w.checkpoint_every} checkpoints only after the last "
                       f"of the workload's {w.steps} steps (and at its evals), as "
                       "checkpoint_every = 0 does",
                       w.span_of("checkpoint_every"),
                       hint=f"checkpoint_every = {max(1, w.steps // 10)} cuts the run into "
                            "pieces a failure rolls back to; 0 says that only the end is meant")


DATA_KEYS = ("prompt_field", "answer_field", "template", "truncation", "split")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")     # a dataset read as one file: no splits


def data_keys_read(site, _) -> SpecError | None:
    w = site.workload
    if w.dataset is not None or site.evaluation is not None:
        return None
    key = next((k for k in DATA_KEYS if k in dict(w.keys)), None)
    if key is None:
        return None
    return SpecError(f"{key} says how a dataset's rows are read, and the workload names no "
                     "dataset (nor is there an eval block)", w.span_of(key),
                     hint='name the prompts\' file: dataset = "data/train.jsonl"; or leave '
                          f"{key} out")


def split_of_a_folder(site, _) -> SpecError | None:
    w, e = site.workload, site.evaluation
    cases = [("split" in dict(w.keys), w.dataset, w.span_of("split"), "the workload's")]
    if e is not None and e.split is not None:
        entry = _eval_entry(site, "split")
        cases.append((True, e.dataset, entry.span if entry else e.span, "the eval block's"))
    for written, dataset, span, whose in cases:
        if not written or dataset is None:
            continue
        path = Path(dataset.path)
        if path.is_file() or (not path.exists() and path.suffix in FILE_SUFFIXES):
            return SpecError(f"split picks a split of a folder saved by datasets' "
                             f"save_to_disk, and {whose} dataset '{dataset.text}' is "
                             "one file, read whole", span,
                             hint="leave split out, or name the saved folder")
    return None


SECTION_RULES = (
    Rule("context", "workload: prompt_len + the longest response fit every model that reads "
         "them"),
    Rule("trained_or_frozen", "model: one with an optimizer is trained by a stage"),
    Rule("shared_optimizers", "share: models of one backbone have one optimizer (lr aside)"),
    Rule("eval_greedy_samples", "eval: samples = 1 at temperature 0"),
    Rule("eval_context", "eval: prompt_len + max_len fit the evaluated model"),
    Rule("eval_every", "eval (warning): every at most the workload's steps"),
    Rule("checkpoint_every", "workload (warning): checkpoint_every at most its steps"),
    Rule("data_keys_read", "workload: prompt_field, answer_field, template, truncation and "
         "split only with a dataset (or an eval block) to read"),
    Rule("split_of_a_folder", "workload, eval: split only for a folder saved by "
         "datasets' save_to_disk"),
)
SECTION_CHECKS = {                 # each section rule by name: the check it runs
    "context": _raised(lambda site: check_context(site.workload, site.models, site.stages,
                                                  site.items)),
    "trained_or_frozen": _raised(lambda site: check_trained(site.models, site.stages,
                                                            site.items, _versioned(site))),
    "shared_optimizers": _raised(lambda site: check_shared_optimizers(site.shares,
                                                                      site.targets, site.items)),
    "eval_greedy_samples": eval_greedy_samples,
    "eval_context": eval_context,
    "eval_every": eval_every,
    "checkpoint_every": checkpoint_every,
    "data_keys_read": data_keys_read,
    "split_of_a_folder": split_of_a_folder,
}


def _versioned(site) -> set[str]:
    return {s.target for s in site.stages if s.kind is OpKind.TRAIN} | {
        n for g in site.shares for n in g}
