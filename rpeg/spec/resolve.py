"""What a file is (pipeline, cluster, profile), and ``extend`` resolved into one item list.

    >>> items, chain = resolve_pipeline(parse_file("pipelines/ppo_async.rpeg"))   # doctest: +SKIP
    >>> chain                                                                       # doctest: +SKIP
    ('pipelines/ppo_llama8b.rpeg',)

A derived pipeline overrides its base by name: a model, reward or stage of the
same name replaces the base's; workload, eval and log keys replace one by one; staleness and
placement replace per stage; ``share`` and ``colocate`` add to the base's.
Within one file every name is defined once.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

from rpeg.errors import Span, SpecError
from rpeg.spec import ast
from rpeg.spec.parser import parse_file
from rpeg.spec.paths import resolve_written, written_folder
from rpeg.spec.values import duplicate

MAX_EXTEND_DEPTH = 16


class FileKind(enum.Enum):
    PIPELINE = "pipeline"
    CLUSTER = "cluster"
    PROFILE = "profile"


_PIPELINE_ITEMS = (ast.PipelineDecl, ast.Extend, ast.WorkloadDecl, ast.ModelDecl, ast.RewardDecl,
                   ast.ToolDecl, ast.StageDecl, ast.Staleness, ast.Share, ast.Colocate, ast.Place,
                   ast.EvalDecl, ast.LogDecl)
# Blocks a pipeline holds once, merged key by key over the base's.
_BLOCKS = {ast.WorkloadDecl: "workload", ast.EvalDecl: "eval", ast.LogDecl: "log"}


def file_kind(f: ast.File) -> FileKind:
    """A file holds one pipeline, one cluster or one profile, and nothing else."""
    if not f.items:
        what = "only comments" if f.comments else "nothing"
        raise SpecError(f"file holds {what}; a .rpeg file must describe one pipeline, cluster or "
                        "profile", Span(f.path, 1, 1),
                        hint="start with 'pipeline NAME' or 'cluster NAME { ... }'")
    clusters = [i for i in f.items if isinstance(i, ast.ClusterDecl)]
    profiles = [i for i in f.items if isinstance(i, ast.ProfileDecl)]
    pipeline = [i for i in f.items if isinstance(i, _PIPELINE_ITEMS)]
    if clusters or profiles:
        if pipeline:
            other = pipeline[0]
            first = (clusters or profiles)[0]
            raise SpecError("a file holds one pipeline or one cluster, not both", other.span,
                            notes=[("the file also describes a cluster here", first.span)],
                            hint="move the cluster into a file of its own and pass it with "
                                 "--cluster")
        if len(clusters) + len(profiles) > 1:
            second = (clusters + profiles)[1]
            raise SpecError("a file holds one cluster or profile; this is a second one",
                            second.span)
        return FileKind.CLUSTER if clusters else FileKind.PROFILE
    decls = [i for i in f.items if isinstance(i, ast.PipelineDecl)]
    if len(decls) > 1:
        raise SpecError(f"a file holds one pipeline; 'pipeline {decls[1].name.value}' is a "
                        "second one", decls[1].span,
                        notes=[("the file's pipeline", decls[0].span)],
                        hint="one pipeline a file: put the second in a file of its own "
                             "(it may 'extend' this one)")
    if not decls:
        raise SpecError("a pipeline file must name its pipeline", f.items[0].span,
                        hint="add 'pipeline NAME' as the first line")
    return FileKind.PIPELINE


def _key(item) -> tuple[str, str] | None:
    if isinstance(item, ast.ModelDecl):
        return ("model", item.name.value)
    if isinstance(item, ast.RewardDecl):
        return ("reward", item.name.value)
    if isinstance(item, ast.ToolDecl):
        return (item.keyword, item.name.value)
    if isinstance(item, ast.StageDecl):
        return ("stage", item.name.value)
    if isinstance(item, ast.Staleness):
        return ("staleness", item.stage.value)
    if isinstance(item, ast.Place):
        return ("place", item.stage.value)
    return None


def _check_unique(f: ast.File) -> None:
    seen: dict[tuple[str, str], ast.Item] = {}
    names: dict[str, ast.Item] = {}
    extends = [i for i in f.items if isinstance(i, ast.Extend)]
    if len(extends) > 1:
        raise SpecError("a pipeline extends at most one base", extends[1].span,
                        notes=[("first extend here", extends[0].span)])
    for kind, word in _BLOCKS.items():
        blocks = [i for i in f.items if isinstance(i, kind)]
        if len(blocks) > 1:
            raise SpecError(f"a pipeline has one {word} block, and this is a second",
                            blocks[1].span, notes=[("the first is here", blocks[0].span)],
                            hint=f"write its keys in the first {word} block")
    for item in f.items:
        key = _key(item)
        if key is None:
            continue
        if key in seen:
            kind = key[0] if key[0] not in ("staleness", "place") else f"{key[0]} of stage"
            raise duplicate(kind, key[1], item.span, seen[key].span)
        seen[key] = item
        if key[0] in ("model", "reward", "tool", "environment"):
            # models, rewards, tools and environments share one namespace: a stage's target
            # names a model or reward, a generate stage's tools the others
            if key[1] in names:
                raise duplicate("name", key[1], item.span, names[key[1]].span)
            names[key[1]] = item


def resolve_pipeline(f: ast.File, _stack: tuple[str, ...] = ()) -> tuple[tuple[ast.Item, ...],
                                                                       tuple[str, ...]]:
    """The pipeline's items with its ``extend`` chain applied, and the chain's paths."""
    _check_unique(f)
    ext = next((i for i in f.items if isinstance(i, ast.Extend)), None)
    own = tuple(i for i in f.items if not isinstance(i, ast.Extend))
    if ext is None:
        return own, ()
    base_path = resolve_written(ext.path.value, ext.path.span)
    real = os.path.realpath(base_path)          # a symlink loop is no error here: below
    here = os.path.realpath(f.path)
    stack = _stack + (here,)
    if real in stack:
        chain = " -> ".join(Path(p).name for p in stack + (real,))
        raise SpecError(f"extend cycle: {chain}", ext.path.span,
                        hint="a pipeline cannot extend itself, directly or through others")
    if len(stack) >= MAX_EXTEND_DEPTH:
        raise SpecError(f"extend chain is deeper than {MAX_EXTEND_DEPTH} files", ext.path.span)
    folder = written_folder(ext.path.span)
    if not os.path.lexists(base_path):
        raise SpecError(f"extend: no such file '{ext.path.value}'", ext.path.span,
                        hint=f"paths are relative to this file's folder ({folder})")
    try:
        base = parse_file(base_path)
    except SpecError as e:
        if e.span is not None and not e.span.line:     # the file itself: said at the extend
            raise SpecError(f"extend '{ext.path.value}': {e.message}", ext.path.span,
                            hint=e.hint or
                            f"paths are relative to this file's folder ({folder})") from None
        e.notes = e.notes + (("while reading the base of this extend", ext.span),)
        raise
    if file_kind(base) is not FileKind.PIPELINE:
        raise SpecError(f"extend must name a pipeline file, and '{ext.path.value}' describes "
                        "a cluster", ext.path.span)
    base_items, chain = resolve_pipeline(base, stack)
    return _merge(base_items, own), (str(base_path),) + chain


def _merge(base: tuple[ast.Item, ...], own: tuple[ast.Item, ...]) -> tuple[ast.Item, ...]:
    """``own`` over ``base`` (in time linear in both: each item found by its key)."""
    decl = next((i for i in own if isinstance(i, ast.PipelineDecl)), None)
    out = [i for i in base if decl is None or not isinstance(i, ast.PipelineDecl)]
    at: dict[object, int] = {}
    for n, item in enumerate(out):
        at.setdefault(_slot(item), n)
    for item in own:
        if item is decl:
            continue
        slot = _slot(item)
        if slot is None or slot not in at:
            at[slot] = len(out)
            out.append(item)
        elif type(item) in _BLOCKS:
            out[at[slot]] = _merge_block(out[at[slot]], item)
        else:
            out[at[slot]] = item
    return ((decl,) if decl is not None else ()) + tuple(out)


def _slot(item) -> object:
    """What an item of a derived file replaces in its base: the same block, or the same
    (kind, name); None for what only adds (share, colocate)."""
    return type(item) if type(item) in _BLOCKS else _key(item)


def _merge_block(base, own):
    """A workload, eval or log block of a derived file over its base's, key by key."""
    entries = list(base.block.entries)
    at = {entry_key(b): n for n, b in reversed(list(enumerate(entries)))}
    for e in own.block.entries:
        if entry_key(e) in at:
            entries[at[entry_key(e)]] = e
        else:
            at[entry_key(e)] = len(entries)
            entries.append(e)
    return type(own)(ast.Block(tuple(entries), own.block.span), own.span)


def entry_key(e: ast.Entry) -> str:
    return e.kind.value if isinstance(e, ast.Section) else e.key.value


def blame(f: ast.File, err: SpecError, lower) -> SpecError:
    """``err`` points into a base file, but the extending file ``f`` may be what causes it (it
    overrides something the base's line relies on): find the item of ``f`` -- or the entry
    of its workload block -- without which ``f`` lowers cleanly, and report ``err`` there,
    with a note at the base's line. ``lower``: ``File -> anything``, raising SpecError."""
    if err.span is None or _same_file(err.span.path, f.path):
        return err
    for where, without in _without_each(f):
        try:
            lower(without)
        except SpecError:
            continue
        return SpecError(err.message, where, hint=err.hint,
                         notes=(("the base file's line this breaks", err.span),) + err.notes)
    return err


def _same_file(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _without_each(f: ast.File):
    """(span, ``f`` without it) for each own item and each entry of its workload block."""
    for n, item in enumerate(f.items):
        if isinstance(item, (ast.PipelineDecl, ast.Extend)):
            continue
        rest = f.items[:n] + f.items[n + 1:]
        if isinstance(item, ast.WorkloadDecl):
            for k, e in enumerate(item.block.entries):
                block = ast.Block(item.block.entries[:k] + item.block.entries[k + 1:],
                                  item.block.span)
                yield e.span, ast.File(f.path, f.items[:n] + (ast.WorkloadDecl(block, item.span),)
                                       + f.items[n + 1:], f.comments, f.source)
        yield item.span, ast.File(f.path, rest, f.comments, f.source)
