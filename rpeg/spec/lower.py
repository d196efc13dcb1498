"""Checks a pipeline's syntax tree and gives it meaning: ``ast.File`` -> ``Pipeline``.

    >>> p, warnings = lower_pipeline(parse_file("pipelines/ppo_llama8b.rpeg"))  # doctest: +SKIP
    >>> [s.name for s in p.stages][:2]                                          # doctest: +SKIP
    ['rollout', 'ref_lp']

Each check raises a SpecError at the span of the offending text, with a hint
where one exists. Problems that do not stop a run being planned (a dataset not
yet on disk) are returned as warnings.
"""

from __future__ import annotations

import ast as pyast
from pathlib import Path

from rpeg.errors import Span, SpecError, SpecWarning, did_you_mean
from rpeg.spec import ast
from rpeg.spec import values as V
from rpeg.spec.arch import lower_dims
from rpeg.spec.calls import keywords
from rpeg.spec.checks import fold_lengths
from rpeg.spec.functions import by_category, declared, default_optimizer, function
from rpeg.spec.keys import (
    DATA,
    MAX_STEPS,
    MAX_TOKENS,
    MODEL,
    MODEL_BLOCK,
    WORKLOAD,
    WORKLOAD_BLOCK,
    assigned,
    entries,
    read,
)
from rpeg.spec.lengths import length
from rpeg.spec.model import (
    WORKLOAD_DATA,
    Head,
    Model,
    OpKind,
    Optimizer,
    Pipeline,
    Reward,
    Stage,
    Workload,
)
from rpeg.spec.paths import FileRef, find_python, resolve_written
from rpeg.spec.pins import lower_place
from rpeg.spec.registry import Category
from rpeg.spec.resolve import blame, resolve_pipeline
from rpeg.spec.rewards import BadSignature, Signature, reward_signature
from rpeg.spec.rules import Site, check_rules
from rpeg.spec.sections import (
    check_weights,
    data_fields,
    hf_model,
    lora,
    lower_eval,
    lower_log,
)
from rpeg.spec.stages import check_roles, lower_stage
from rpeg.spec.tools import Tool, check_conversations, check_signature

__all__ = ["lower_pipeline", "WORKLOAD_KEYS", "MODEL_KEYS", "MAX_STEPS", "MAX_TOKENS"]

WORKLOAD_KEYS = WORKLOAD_BLOCK.keys
MODEL_KEYS = MODEL_BLOCK.keys


def lower_pipeline(f: ast.File, overrides: tuple = ()) -> tuple[Pipeline, list[SpecError]]:
    """Resolve ``extend``, apply command-line ``overrides`` (``rpeg.spec.overrides``) and check
    everything; return the pipeline and any warnings.

    An error in a base file's text that the extending file causes (it overrides what the
    base's line relies on) is reported at the extending file's line, with a note into the
    base (:func:`rpeg.spec.resolve.blame`)."""
    items, chain = _resolved(f, overrides)
    try:
        return _lower(f, items, chain)
    except SpecError as e:
        if not chain:
            raise
        raise blame(f, e, lambda fi: _lower(fi, *_resolved(fi, overrides))) from None


def _resolved(f: ast.File, overrides: tuple):
    items, chain = resolve_pipeline(f)
    if overrides:
        from rpeg.spec.overrides import apply_overrides
        items = apply_overrides(items, overrides)
    return items, chain


def _lower(f: ast.File, items, chain) -> tuple[Pipeline, list[SpecError]]:
    warnings: list[SpecError] = []
    decl = next(i for i in items if isinstance(i, ast.PipelineDecl))
    wl_items = [i for i in items if isinstance(i, ast.WorkloadDecl)]
    if not wl_items:
        raise SpecError(f"pipeline '{decl.name.value}' has no workload block", decl.span,
                        hint="add 'workload { steps = ...; prompts = ...; prompt_len = ...; "
                             "gen_len = ... }'")
    workload = _workload(wl_items[0], warnings)
    models = tuple(_model(m, warnings) for m in items if isinstance(m, ast.ModelDecl))
    rewards = tuple(_reward(r, warnings) for r in items if isinstance(r, ast.RewardDecl))
    tools = tuple(_tool(t) for t in items if isinstance(t, ast.ToolDecl))
    targets = {m.name: m for m in models} | {r.name: r for r in rewards}
    stages = tuple(lower_stage(s, targets) for s in items if isinstance(s, ast.StageDecl))
    if not stages:
        raise SpecError(f"pipeline '{decl.name.value}' has no stages", decl.span,
                        hint="add at least 'stage rollout = generate(MODEL, prompts) -> responses'")
    _check_dataflow(stages, items)
    _check_trainers(stages, items)
    by_stage = {s.name: s for s in stages}
    # models whose weights change during a run: trained, or sharing a backbone that may be
    versioned = {st.target for st in stages if st.kind is OpKind.TRAIN} | {
        n.value for i in items if isinstance(i, ast.Share) for n in i.names}
    staleness = tuple(_staleness(i, by_stage, targets, versioned) for i in items
                      if isinstance(i, ast.Staleness))
    shares = _share_groups([i for i in items if isinstance(i, ast.Share)], targets)
    colocate = tuple(_colocate(i, by_stage, targets) for i in items if isinstance(i, ast.Colocate))
    place = tuple(lower_place(i, by_stage, targets) for i in items
                  if isinstance(i, ast.Place))
    check_roles(stages, items, targets, workload)
    workload = fold_lengths(workload, stages, items)
    check_conversations(stages, tools, items, workload, warnings)
    _check_unused(stages, models, items, warnings)
    evaluation = next((lower_eval(i, rewards, warnings) for i in items
                       if isinstance(i, ast.EvalDecl)), None)
    log = next((lower_log(i) for i in items if isinstance(i, ast.LogDecl)), None)
    # every function's and section's preconditions (rpeg.spec.rules)
    warnings += check_rules(Site(tuple(items), workload, models, rewards, stages, shares,
                                 evaluation))
    pipeline = Pipeline(
        name=decl.name.value, path=f.path, workload=workload, models=models, rewards=rewards,
        stages=stages, staleness=staleness, shares=shares, colocate=colocate, place=place,
        extends=chain, evaluation=evaluation, **({"log": log} if log else {}), tools=tools)
    return pipeline, warnings


# --- workload ----------------------------------------------------------------

def _workload(w: ast.WorkloadDecl, warnings: list[SpecError]) -> Workload:
    e = entries(w.block, WORKLOAD_BLOCK, "the workload block")
    for required in (p.name for p in WORKLOAD_BLOCK.params if p.required):
        if required not in e:
            raise SpecError(f"the workload block must set {required}", w.span,
                            hint=f"add '{required} = ...'")

    def get(key: str) -> object:
        return read(e[key], WORKLOAD.param(key)) if key in e else WORKLOAD.param(key).default

    steps, prompts, samples, seed = get("steps"), get("prompts"), get("samples"), get("seed")
    pv = assigned(e["prompt_len"], "prompt_len")
    prompt_dist = None if isinstance(pv, ast.Number) else length(pv, "prompt_len")
    prompt_len = prompt_dist.max_len if prompt_dist else V.integer(
        pv, "prompt_len", minimum=1, maximum=MAX_TOKENS)
    gen_len = length(assigned(e["gen_len"], "gen_len"))
    dataset = None
    if "dataset" in e:
        dv = assigned(e["dataset"], "dataset")
        dataset = FileRef.written(read(e["dataset"], DATA.param("dataset")), dv.span)
        if not dataset.exists():
            warnings.append(SpecWarning(f"dataset {dataset.described()} does not exist (yet); "
                                        "a run needs it", dv.span))
    fields, template, split, truncation = data_fields(e)
    return Workload(steps, prompts, samples, prompt_len, gen_len, dataset, seed, w.span,
                    fields=fields, template=template, split=split, prompt_dist=prompt_dist,
                    truncation=truncation, checkpoint_every=get("checkpoint_every"),
                    keep_checkpoints=get("keep_checkpoints"),
                    keys=tuple((k, x.span) for k, x in e.items()))


# --- models and rewards ------------------------------------------------------

def _model(m: ast.ModelDecl, warnings: list[SpecError]) -> Model:
    preset = m.preset.value
    e = entries(m.block, MODEL_BLOCK, f"model '{m.name.value}'") if m.block else {}
    folder_dtype, weights = None, None
    if m.source is not None:
        dims, folder_dtype, weights = hf_model(m, e)
    elif preset == "hf":
        raise SpecError("hf needs the model's folder: hf(\"path/to/folder\")", m.preset.span,
                        hint="the folder holds config.json, the weights and the tokenizer")
    else:
        dims = lower_dims(m.preset, e)
    head = Head(read(e["head"], MODEL.param("head")) if "head" in e
                else MODEL.param("head").default)
    frozen = "frozen" in e
    if frozen and not isinstance(e["frozen"], ast.Flag):
        raise SpecError("frozen is a flag: write 'frozen' alone", e["frozen"].span)
    optimizer = None
    if "optimizer" in e:
        if frozen:
            raise SpecError(f"model '{m.name.value}' is frozen and cannot have an optimizer",
                            e["optimizer"].span, hint="remove 'frozen' or the optimizer")
        optimizer = _optimizer(assigned(e["optimizer"], "optimizer"))
    elif not frozen:
        optimizer = _optimizer_of(default_optimizer(), {})
    dtype = read(e["dtype"], MODEL.param("dtype")) if "dtype" in e else folder_dtype or "bf16"
    if optimizer is not None and not optimizer.master and dtype == "fp32":
        raise SpecError("master_weights = false must be asked of a 16-bit model, not of dtype "
                        "fp32 (float32 weights are their own master weights)",
                        e["optimizer"].span, hint="drop master_weights, or use dtype bf16")
    if "weights" in e:
        wv = assigned(e["weights"], "weights")
        written = read(e["weights"], MODEL.param("weights"))
        weights = _weights_dir(written, warnings, wv.span)
        if preset != "custom":
            check_weights(m, dims, weights, wv.span, warnings, written)
    adapters = None
    if "lora" in e:
        if frozen or head is not Head.LM:
            raise SpecError("lora adapts a trained language model; this one is "
                            + ("frozen" if frozen else f"a {head.value} model"), e["lora"].span,
                            hint="remove 'frozen' or 'lora'" if frozen else "remove 'lora'")
        adapters = lora(assigned(e["lora"], "lora"), dims)
    return Model(m.name.value, preset, dims, head, frozen, optimizer, dtype, weights, m.span,
                 lora=adapters)


def _optimizer(v: ast.Value) -> Optimizer:
    names = tuple(f.name for f in by_category(Category.OPTIMIZER))
    if not isinstance(v, ast.Call) or v.func.value not in names:
        raise SpecError(f"optimizer must be one of {', '.join(n + '(lr = ...)' for n in names)}, "
                        f"not {V.describe(v)}", v.span)
    fn = function(v.func.value)
    return _optimizer_of(fn, {k: value for k, (value, _) in
                              keywords(fn, v.args, v.kwargs, f"{fn.name}(...)").items()})


def _optimizer_of(fn, given: dict) -> Optimizer:
    kw = fn.resolve(given)
    return Optimizer(kind=fn.name, lr=kw["lr"], betas=(kw["beta1"], kw["beta2"]),
                     weight_decay=kw["weight_decay"], eps=kw["eps"], grad_clip=kw["grad_clip"],
                     master=kw["master_weights"], schedule=kw["schedule"], warmup=kw["warmup"],
                     min_lr=kw["min_lr"])


def _weights_dir(text: str, warnings: list[SpecError], span: Span) -> str:
    """A model's weights folder as an absolute path, relative to the folder of the file
    that names it (``rpeg.spec.paths``): every later reader (the runtime's workers, whatever
    their working directory) gets the absolute path. A folder not there yet is a warning
    here and an error at run time, like the dataset.
    """
    where = resolve_written(text, span)
    if not where.is_dir():
        warnings.append(SpecWarning(f"weights directory '{text}' does not exist (yet); a run "
                                    "needs it", span))
    return str(where)


def _reward(r: ast.RewardDecl, warnings: list[SpecError]) -> Reward:
    c = r.call
    kinds = tuple(f.name for f in by_category(Category.REWARD))
    if c.func.value not in kinds:
        raise SpecError(f"a reward must be one of {', '.join(k + '(...)' for k in kinds)}, not "
                        f"{V.describe(c)}", c.span,
                        hint='python("module:function") names your own reward function')
    fn = function(c.func.value)
    given = keywords(fn, c.args, c.kwargs, f"{fn.name}(...)")
    if not fn.user_code:
        return Reward(r.name.value, "", "", r.span, kind=fn.name,
                      params=tuple((k, v) for k, (v, _) in given.items()))
    module, function_, where = _python_ref(fn, given, c.span, "function")
    found = find_python(module, function_, where)
    try:
        sig = reward_signature(found.source, module, function_, where)
    except BadSignature:
        sig = Signature()         # the reward_signature rule says what is wrong with it
    return Reward(r.name.value, module, function_, r.span, kind=fn.name,
                  params=tuple((k, v) for k, (v, _) in given.items() if k != "ref"),
                  source=found.source, folder=found.folder, form=sig.form, columns=sig.columns)


def _tool(t: ast.ToolDecl) -> Tool:
    """``tool NAME = python("module:function", ...)`` or ``environment NAME = ...``: the
    code found by reading its source, its signature checked, the sandbox's limits."""
    category = Category.ENVIRONMENT if t.environment else Category.TOOL
    code = "Class" if t.environment else "function"
    c = t.call
    fn = declared(category, c.func.value)
    if fn is None:
        kinds = [f.name for f in by_category(category)]
        raise SpecError(f"{t.keyword} '{t.name.value}' must be one of "
                        f"{', '.join(k + '(...)' for k in kinds)}, not {V.describe(c)}", c.span,
                        hint=f'python("module:{code}") names your own code')
    given = keywords(fn, c.args, c.kwargs, f"{fn.name}(...)")
    module, function_, where = _python_ref(fn, given, c.span, code)
    found = find_python(module, function_, where, what=t.keyword)
    args = fn.resolve({k: v for k, (v, _) in given.items()})
    tool = Tool(t.name.value, module, function_, t.span, environment=t.environment,
                timeout=args["timeout"], memory=args["memory"], max_output=args["max_output"],
                cores=args["cores"], latency=args["latency"], kind=fn.name,
                source=found.source, folder=found.folder)
    check_signature(tool, _source_tree(found.source, where), found.source, where)
    return tool


def _python_ref(fn, given: dict, span: Span, code: str) -> tuple[str, str, Span]:
    """The ``"module:NAME"`` a ``python(...)`` declaration names: (module, name, where)."""
    if "ref" not in given:
        raise SpecError(f'{fn.name}(...) must name "module:{code}"', span)
    ref, where = given["ref"]
    if ref.count(":") != 1 or not all(part.replace(".", "").replace("_", "a").isalnum()
                                      for part in ref.split(":")):
        raise SpecError(f'{fn.name}(...) must name "module:{code}", not "{ref}"', where)
    module, name = ref.split(":")
    return module, name, where


def _source_tree(source: str, span: Span) -> pyast.Module:
    try:
        return pyast.parse(Path(source).read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError) as e:
        raise SpecError(f"'{source}' cannot be read: {e}", span) from None


# --- stages ------------------------------------------------------------------

def _check_trainers(stages: tuple[Stage, ...], items) -> None:
    """One train stage per model: a second would write a second new version in one step."""
    decls = {i.name.value: i for i in items if isinstance(i, ast.StageDecl)}
    first: dict[str, Stage] = {}
    for s in stages:
        if s.kind is not OpKind.TRAIN:
            continue
        if s.target in first:
            other = first[s.target]
            raise SpecError(f"model '{s.target}' is trained by two stages, '{other.name}' and "
                            f"'{s.name}'", decls[s.name].call.args[0].span,
                            notes=[("first trained here", decls[other.name].span)],
                            hint="train each model in one stage (epochs and minibatches "
                                 "repeat it)")
        first[s.target] = s


def _check_dataflow(stages: tuple[Stage, ...], items) -> None:
    decls = {i.name.value: i for i in items if isinstance(i, ast.StageDecl)}
    producer: dict[str, Stage] = {}
    for s in stages:
        for o in s.outputs:
            if o in producer:
                first = producer[o]
                raise SpecError(f"'{o}' is produced by two stages, '{first.name}' and "
                                f"'{s.name}'", _output_span(decls[s.name], o),
                                notes=[(f"also produced by '{first.name}' here",
                                        _output_span(decls[first.name], o))],
                                hint="rename one of the outputs")
            producer[o] = s
    for s in stages:
        for data in s.inputs:
            if data not in producer and data not in WORKLOAD_DATA:
                arg = _input_span(decls[s.name], data)
                raise SpecError(f"'{data}' is read by stage '{s.name}' but no stage produces it",
                                arg, hint=did_you_mean(data, list(producer) + list(WORKLOAD_DATA))
                                or "add a stage with '-> " + data + "'")
    # cycles inside one step: depth-first search over stage -> consumer edges
    deps = {s.name: [producer[d].name for d in s.inputs if d in producer] for s in stages}
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in deps[name]:
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep] if dep in path else [name, dep]
                raise SpecError("stages depend on each other in a cycle: "
                                + " -> ".join(reversed(cycle)), decls[dep].span,
                                hint="data inside one step must flow one way; state across "
                                     "steps flows through model versions (staleness)")
            if state.get(dep) is None:
                visit(dep, path + [dep])
        state[name] = 2

    for s in stages:
        if s.name not in state:
            visit(s.name, [s.name])


def _output_span(decl: ast.StageDecl, name: str) -> Span:
    return next((o.span for o in decl.outputs if o.value == name), decl.span)


def _input_span(decl: ast.StageDecl, name: str) -> Span:
    values = list(decl.call.args) + [k.value for k in decl.call.kwargs]
    return next((a.span for a in values if isinstance(a, ast.Ident) and a.value == name),
                decl.span)


# --- structural statements ------------------------------------------------------

def _staleness(i: ast.Staleness, stages: dict[str, Stage], targets,
               versioned: set[str]) -> tuple[str, int]:
    if i.stage.value not in stages:
        raise SpecError(f"staleness names unknown stage '{i.stage.value}'", i.stage.span,
                        hint=did_you_mean(i.stage.value, stages))
    b = i.bound
    if isinstance(b, ast.Number) and b.value < 0:
        raise SpecError(f"staleness bound must be a non-negative integer, not {b.text}", b.span,
                        hint="0 means synchronous; 1 lets the stage read weights one update old")
    k = V.integer(b, "staleness bound", minimum=0, maximum=64)
    s = stages[i.stage.value]
    if s.kind is OpKind.TRAIN:
        raise SpecError(f"staleness on train stage '{s.name}': a train stage always reads the "
                        "latest version of the model it writes", i.span)
    model = targets.get(s.target) if s.target else None
    if not isinstance(model, Model) or model.frozen:
        what = f"frozen model '{model.name}'" if isinstance(model, Model) else \
            ("reward '" + s.target + "'" if s.target else "no model")
        raise SpecError(f"staleness on stage '{s.name}', which reads {what}: only a stage that "
                        "reads a trained model's weights can read an older version", i.span)
    if model.name not in versioned:
        raise SpecError(f"staleness on stage '{s.name}', which reads model '{model.name}' that no "
                        "stage trains: its weights never change, so there is no older version "
                        "to read", i.span, hint=f"add a train stage for '{model.name}', or drop "
                        "this staleness")
    return (s.name, k)


def _share_groups(decls: list[ast.Share], targets) -> tuple[tuple[str, ...], ...]:
    """Each ``share`` checked; a group repeated (say, by an extending file) counts once, and a
    model may belong to one group only -- one backbone cannot be merged into two."""
    groups: list[tuple[str, ...]] = []
    owner: dict[str, ast.Share] = {}
    for decl in decls:
        group = _share(decl, targets)
        if any(set(group) == set(g) for g in groups):
            continue
        for n in decl.names:
            if n.value in owner:
                first = owner[n.value]
                raise SpecError(f"model '{n.value}' is already shared with "
                                f"{', '.join(x.value for x in first.names if x.value != n.value)}"
                                "; a model may be in one share group only", n.span,
                                notes=[("shared here", first.span)],
                                hint="list every model of one backbone in one statement: share "
                                     + ", ".join(dict.fromkeys([x.value for x in first.names]
                                                               + list(group))))
            owner[n.value] = decl
        groups.append(group)
    return tuple(groups)


def _share(i: ast.Share, targets) -> tuple[str, ...]:
    names = tuple(n.value for n in i.names)
    if len(names) < 2:
        raise SpecError("share needs at least two models: share actor, critic", i.span)
    first: Model | None = None
    for n in i.names:
        m = targets.get(n.value)
        if not isinstance(m, Model):
            raise SpecError(f"share names unknown model '{n.value}'", n.span,
                            hint=did_you_mean(n.value, [k for k, v in targets.items()
                                                        if isinstance(v, Model)]))
        if m.frozen:
            raise SpecError(f"cannot share the backbone of frozen model '{m.name}' with a "
                            "trained one", n.span)
        if first is None:
            first = m
        elif m.dims.backbone_key() != first.dims.backbone_key():
            raise _unlike_backbones(first, m, n.span)
    if len(set(names)) != len(names):
        raise SpecError("share lists a model twice", i.span)
    return names


_BACKBONE_FIELDS = ("family", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab")


def _unlike_backbones(first: Model, m: Model, span: Span) -> SpecError:
    """Two models whose backbones differ: which dimension, and the override that made two
    models of one preset differ."""
    a, b = first.dims.backbone_key(), m.dims.backbone_key()
    field, x, y = next((f, x, y) for f, x, y in zip(_BACKBONE_FIELDS, a, b, strict=True)
                       if x != y)
    if first.preset == m.preset:
        what = (f"'{first.name}' and '{m.name}' are both {m.preset}, with {field} = {x} and "
                f"{field} = {y} (an override of the preset's dimensions)")
    else:
        what = (f"'{first.name}' is {first.preset} ({field} = {x}) and '{m.name}' is "
                f"{m.preset} ({field} = {y})")
    return SpecError(f"cannot share models of different architectures: {what}", span,
                     notes=[(f"'{first.name}' is declared here", first.span),
                            (f"'{m.name}' is declared here", m.span)],
                     hint=f"shared models need the same backbone: give both {field} = {x}, or "
                          "share neither")


def _colocate(i: ast.Colocate, stages, targets) -> tuple[str, ...]:
    names = tuple(n.value for n in i.names)
    if len(names) < 2:
        raise SpecError("colocate needs at least two stages or models", i.span)
    for n in i.names:
        if n.value not in stages and n.value not in targets:
            raise SpecError(f"colocate names unknown stage or model '{n.value}'", n.span,
                            hint=did_you_mean(n.value, list(stages) + list(targets)))
    return names


def _check_unused(stages, models, items, warnings: list[SpecError]) -> None:
    used = {s.target for s in stages}
    for m in models:
        if m.name not in used:
            warnings.append(SpecWarning(f"model '{m.name}' is declared but no stage uses it",
                                      m.span))
    read = {d for s in stages for d in s.inputs}
    for s in stages:
        for o in s.outputs:
            if o not in read and s.kind is not OpKind.SCORE:
                warnings.append(SpecWarning(f"'{o}' is produced by stage '{s.name}' but never "
                                          "read", s.span))
