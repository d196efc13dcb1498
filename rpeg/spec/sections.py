"""Checks for a model's folder and adapters, the workload's data fields, and the eval and
log blocks: syntax tree in, ``rpeg.spec.training`` values out.

    >>> from rpeg.spec import load
    >>> p = load("pipelines/smollm2_gsm.rpeg")                     # doctest: +SKIP
    >>> p.evaluation.every, p.model("actor").preset                 # doctest: +SKIP
    (10, 'hf')

Called from ``rpeg.spec.lower``; each problem is a SpecError at the span of the text that
causes it.
"""

from __future__ import annotations

from pathlib import Path

from rpeg.errors import Span, SpecError, SpecWarning, did_you_mean
from rpeg.spec import ast
from rpeg.spec import values as V
from rpeg.spec.hf import ConfigProblem, disagreements, folder_dims
from rpeg.spec.keys import ARCHITECTURE, DATA, EVAL, LOG, LORA, assigned, convert, entries, read
from rpeg.spec.paths import FileRef, resolve_written
from rpeg.spec.presets import ModelDims
from rpeg.spec.training import (
    LORA_TARGETS,
    Evaluation,
    Fields,
    Logging,
    Lora,
    Template,
    Tracker,
    Truncation,
    projection_shapes,
)

DATA_KEYS = DATA.keys
EVAL_KEYS = EVAL.keys
LOG_KEYS = LOG.keys


# --- a model's folder ------------------------------------------------------------------------

def hf_model(m: ast.ModelDecl, e: dict[str, ast.Entry]) -> tuple[ModelDims, str | None, str]:
    """``model NAME : hf("FOLDER")``: (dims, dtype or None, the folder's absolute path). The
    folder must be there at check time: its config.json is the model's shape."""
    if m.preset.value != "hf":
        raise SpecError(f"a model read from a folder is written hf(\"FOLDER\"), not "
                        f"{m.preset.value}(...)", m.preset.span,
                        hint="write a preset alone (llama3.1-8b), or hf(\"path/to/folder\")")
    for key in (*ARCHITECTURE.keys, "weights"):
        if key in e:
            raise SpecError(f"hf(...) takes the model's {'folder' if key == 'weights' else key} "
                            f"from the folder, so '{key}' must not be set here",
                            e[key].span, hint=f"remove '{key}'")
    folder = resolve_written(m.source.value, m.source.span)
    if not folder.is_dir():
        raise SpecError(f"hf(...) folder '{m.source.value}' must exist, and it does not "
                        f"(looked for {folder})", m.source.span,
                        hint="the path is relative to the folder of the file that names it; "
                             "the planner reads the model's shape from its config.json")
    try:
        dims, dtype = folder_dims(folder)
    except ConfigProblem as p:
        raise SpecError(str(p), m.source.span,
                        hint="rpeg reads config.json only and runs no code from the folder"
                        ) from None
    return dims, dtype, str(folder)


def check_weights(m: ast.ModelDecl, dims: ModelDims, weights: str, weights_span: Span,
                  warnings: list[SpecError], written: str | None = None) -> None:
    """A preset with ``weights = "FOLDER"`` must describe the folder's model."""
    folder = Path(weights)
    if not (folder / "config.json").is_file():
        if folder.is_dir():
            warnings.append(SpecWarning(f"weights folder '{folder}' holds no config.json; its "
                                        f"shape cannot be checked against {m.preset.value}",
                                        weights_span))
        return
    try:
        got, _ = folder_dims(folder)
    except ConfigProblem as p:
        raise SpecError(str(p), weights_span) from None
    diff = disagreements(dims, got)
    if diff:
        listed = ", ".join(f"{k} {_v(a)} (folder: {_v(b)})" for k, a, b in diff)
        raise SpecError(f"preset {m.preset.value} must describe the model in its weights "
                        f"folder, and it differs: {listed}", m.preset.span,
                        notes=[("the weights folder is named here", weights_span)],
                        hint=f"write hf(\"{written or folder}\") to take the shape from "
                             "the folder")


def _v(x: object) -> str:
    return str(x).lower() if isinstance(x, bool) else str(x)


def lora(v: ast.Value, dims: ModelDims | None = None) -> Lora:
    """``lora(rank = 8, alpha = 16, targets = [q_proj, v_proj], dropout = 0.05)``; with the
    model's ``dims``, the rank at most its hidden size and every target one it has."""
    if not isinstance(v, ast.Call) or v.func.value != "lora":
        raise SpecError(f"lora must be lora(rank = ...), not {V.describe(v)}", v.span,
                        hint="lora = lora(rank = 8) adapts q_proj, k_proj, v_proj and o_proj; "
                             "targets = [...] names others")
    allowed = LORA.keys
    kw = {}
    for k in v.kwargs:
        if k.key.value not in allowed:
            raise V.unknown_key(k.key, allowed, "lora(...)")
        kw[k.key.value] = k.value
    if v.args:
        kw.setdefault("rank", v.args[0])
    if "rank" not in kw:
        raise SpecError("lora(...) needs rank = N", v.span, hint="lora(rank = 8, alpha = 16)")
    most = LORA.param("rank").high
    rank = V.integer(kw["rank"], "rank", minimum=1,
                     maximum=int(min(most, dims.hidden) if dims is not None else most))
    alpha = convert(kw["alpha"], LORA.param("alpha")) if "alpha" in kw else 0.0
    dropout = convert(kw["dropout"], LORA.param("dropout")) if "dropout" in kw \
        else LORA.param("dropout").default
    targets = Lora.__attrs_attrs__.targets.default
    if "targets" in kw:
        tv = kw["targets"]
        if not isinstance(tv, ast.ListValue) or not tv.items:
            raise SpecError(f"targets must be a list of projections such as [q_proj, v_proj], "
                            f"not {V.describe(tv)}", tv.span)
        has = projection_shapes(dims) if dims is not None else dict.fromkeys(LORA_TARGETS)
        names = []
        for x in tv.items:
            n = x.value if isinstance(x, (ast.Ident, ast.Str)) else None
            if n not in LORA_TARGETS:
                raise SpecError(f"a lora target must be one of {', '.join(LORA_TARGETS)}, not "
                                f"{V.describe(x)}", x.span, hint=did_you_mean(str(n),
                                                                              LORA_TARGETS))
            if n not in has:
                raise SpecError(f"a lora target must be a projection the model has "
                                f"({', '.join(has)}), not {n}", x.span,
                                hint="a plain (non-gated) MLP's matrices are up_proj and "
                                     "down_proj")
            if n in names:
                raise SpecError(f"lora target '{n}' is listed twice", x.span)
            names.append(n)
        targets = tuple(names)
    return Lora(rank, alpha, targets, dropout)


# --- the workload's data fields ---------------------------------------------------------------

def data_fields(e: dict[str, ast.Entry]) -> tuple[Fields, Template, str | None, Truncation]:
    def text(key: str) -> str | None:
        if key not in e:
            return DATA.param(key).default
        value = read(e[key], DATA.param(key))
        if not value:
            raise SpecError(f"{key} must name a column, not an empty string", e[key].span)
        return value

    fields = Fields(text("prompt_field"), text("answer_field"))
    if fields.prompt == fields.answer:
        raise SpecError(f"prompt_field and answer_field must be different columns, not both "
                        f"'{fields.prompt}'", e["answer_field"].span if "answer_field" in e
                        else e["prompt_field"].span)
    template = Template(read(e["template"], DATA.param("template")) if "template" in e
                        else DATA.param("template").default)
    truncation = Truncation(read(e["truncation"], DATA.param("truncation")) if "truncation" in e
                            else DATA.param("truncation").default)
    return fields, template, text("split"), truncation


# --- eval { ... } -------------------------------------------------------------------------

def lower_eval(decl: ast.EvalDecl, rewards: tuple,
               warnings: list[SpecError]) -> Evaluation:
    e = entries(decl.block, EVAL, "the eval block")
    for required in (p.name for p in EVAL.params if p.required):
        if required not in e:
            raise SpecError(f"the eval block must set {required}", decl.span,
                            hint='eval { dataset = "data/test.jsonl"; every = 10 }')
    dv = assigned(e["dataset"], "dataset")
    dataset = FileRef.written(read(e["dataset"], EVAL.param("dataset")), dv.span)
    if not dataset.exists():
        warnings.append(SpecWarning(f"eval dataset {dataset.described()} does not exist (yet); "
                                    "a run needs it", dv.span))

    def get(key: str, default: object) -> object:
        return read(e[key], EVAL.param(key)) if key in e else default

    every = get("every", None)          # within the run: the eval_every rule (rpeg.spec.checks)
    samples = get("samples", EVAL.param("samples").default)
    temperature = get("temperature", EVAL.param("temperature").default)
    prompts = get("prompts", 0)
    max_len = get("max_len", 0)
    names = [r.name for r in rewards]
    if "reward" in e:
        rv = assigned(e["reward"], "reward")
        reward = read(e["reward"], EVAL.param("reward"))
        if reward not in names:
            raise SpecError(f"eval reward must name a reward of the pipeline, not '{reward}'",
                            rv.span, hint=did_you_mean(reward, names))
    elif len(names) == 1:
        reward = names[0]
    else:
        raise SpecError(f"the eval block must say which reward scores it (the pipeline has "
                        f"{len(names) or 'no'} rewards{': ' + ', '.join(names) if names else ''})",
                        decl.span, hint="add reward = NAME, with a reward = python(...) "
                                        "declared in the pipeline")
    split = get("split", None)
    return Evaluation(dataset, every, samples, temperature, prompts, max_len, reward, split,
                      decl.span, keys=tuple((k, x.span) for k, x in e.items()))


# --- log { ... } ----------------------------------------------------------------------------

def lower_log(decl: ast.LogDecl) -> Logging:
    e = entries(decl.block, LOG, "the log block")
    trackers = Logging.__attrs_attrs__.trackers.default
    if "trackers" in e:
        tv = assigned(e["trackers"], "trackers")
        items = tv.items if isinstance(tv, ast.ListValue) else (tv,)
        choices = tuple(t.value for t in Tracker)
        got = []
        for x in items:
            t = Tracker(V.name(x, "tracker", choices))
            if t in got:
                raise SpecError(f"tracker {t.value} is listed twice", x.span)
            got.append(t)
        trackers = tuple(got)
    samples = read(e["samples"], LOG.param("samples")) if "samples" in e \
        else LOG.param("samples").default
    project = read(e["project"], LOG.param("project")) if "project" in e \
        else LOG.param("project").default
    return Logging(trackers, samples, project, decl.span)
