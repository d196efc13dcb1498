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
"""

from __future__ import annotations

import attrs

from rpeg.errors import Span, SpecError
from rpeg.spec import ast
from rpeg.spec.model import Model, OpKind, Stage, Workload


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


