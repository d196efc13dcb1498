"""Stages checked against the registry: targets, keywords, and the roles of what flows.

    >>> p = load("pipelines/tiny_grpo.rpeg")                       # doctest: +SKIP
    >>> roles_of(p)["ref_logprobs"]                                  # doctest: +SKIP
    <Role.REF_LOGPROBS: 'ref_logprobs'>

``lower_stage`` turns one ``stage NAME = FUNCTION(target, inputs..., k = v) -> outputs``
into a :class:`Stage`; ``check_roles`` then checks the whole step's dataflow by role:
every datum's role comes from the function that produces it (a forward's from its
model's head), and every function declares the roles it reads and writes. So a forward
with no responses, an estimator missing the values it needs, a stage naming more
outputs than its function produces, a keyword that needs an input the stage does not
read, and an estimator that needs several samples per prompt where the workload has
one are each one check, for every function.
"""

from __future__ import annotations

from rpeg.errors import Span, SpecError, did_you_mean
from rpeg.spec import ast
from rpeg.spec import values as V
from rpeg.spec.calls import keywords, not_a_stage_function
from rpeg.spec.functions import find, function, loss_for
from rpeg.spec.model import WORKLOAD_DATA, Head, Model, OpKind, Reward, Stage, Workload
from rpeg.spec.registry import Category, Function, Role, Slot, Target, Type, output_roles


def lower_stage(s: ast.StageDecl, targets: dict[str, Model | Reward]) -> Stage:
    name = s.call.func.value
    fn = find(name)
    if fn is None or fn.kind is None:
        raise not_a_stage_function(name, s.call.func.span)
    kind = fn.kind
    args = list(s.call.args)
    for a in args:
        if not isinstance(a, ast.Ident):
            raise SpecError(f"arguments of {name}(...) must be names of models and data, "
                            f"not {V.kind_of(a)} ({V.describe(a)})", a.span,
                            hint="settings go in keyword form: name = value")
    target = None
    if fn.target is not Target.NONE:
        if not args:
            raise SpecError(f"{name}(...) needs the {_target_word(fn)} it runs as its first "
                            "argument", s.call.span)
        t = args.pop(0)
        target = t.value
        _check_target(fn, t, targets)
    for a in args:
        if a.value in targets:
            raise SpecError(f"'{a.value}' is a model or reward, not data; only the first "
                            f"argument of {name}(...) names one", a.span)
    given = keywords(fn, (), s.call.kwargs, f"{name}(...)")
    params = tuple((k, v) for k, (v, _) in given.items())
    model = targets.get(target) if target else None
    if kind is OpKind.TRAIN:
        params = _with_loss(params, given, model, s.call.span)
    data_keys = [k for k, _ in params if fn.has(k) and fn.param(k).type is Type.DATA]
    inputs = tuple(a.value for a in args) + tuple(str(dict(params)[k]) for k in data_keys)
    if len(set(inputs)) != len(inputs):
        dup = next(n for i, n in enumerate(inputs) if n in inputs[:i])
        raise SpecError(f"'{dup}' is passed twice", _arg_span(s, dup))
    outputs = tuple(o.value for o in s.outputs)
    for n, o in enumerate(s.outputs):
        if o.value in outputs[:n]:
            raise SpecError(f"output '{o.value}' is listed twice", o.span)
        if o.value in targets:
            raise SpecError(f"output '{o.value}' has the name of a model or reward", o.span)
        if o.value in WORKLOAD_DATA:
            raise SpecError(f"'{o.value}' comes from the workload and cannot be produced by a "
                            "stage", o.span)
    if kind is OpKind.TRAIN and outputs:
        raise SpecError("a train stage produces a new version of its model, not data", s.span,
                        hint="remove the '-> ...' outputs")
    if kind is not OpKind.TRAIN and not outputs:
        raise SpecError(f"stage '{s.name.value}' produces nothing", s.call.span,
                        hint="name its outputs: '-> name, ...'")
    return Stage(s.name.value, kind, name, target, inputs, outputs, params, s.span)


def _target_word(fn: Function) -> str:
    return "reward" if fn.target is Target.SCORER else "model"


def _check_target(fn: Function, t: ast.Ident, targets) -> None:
    name = fn.name
    if t.value not in targets:
        what = "reward or model" if fn.target is Target.SCORER else "model"
        raise SpecError(f"unknown {what} '{t.value}'", t.span, hint=did_you_mean(t.value, targets))
    obj = targets[t.value]
    if fn.target is Target.SCORER:
        if isinstance(obj, Model) and obj.head is not Head.REWARD:
            raise SpecError(f"score(...) needs a reward or a model with head = reward; "
                            f"'{t.value}' has head = {obj.head.value}", t.span)
        return
    if not isinstance(obj, Model):
        raise SpecError(f"{name}(...) runs a model, and '{t.value}' is a reward", t.span,
                        hint=f"use score({t.value}, ...) to run a reward")
    if fn.target is Target.TRAINABLE and obj.frozen:
        raise SpecError(f"cannot train frozen model '{t.value}'", t.span,
                        notes=[("declared frozen here", obj.span)],
                        hint="remove 'frozen' from the model, or drop this train stage")
    if fn.target is Target.LM and obj.head is not Head.LM:
        raise SpecError(f"{name}(...) needs a language model; '{t.value}' has head = "
                        f"{obj.head.value}", t.span)


def _with_loss(params, given, model, span: Span):
    """A train stage's loss: checked against the model's head; the head's default if absent."""
    if "loss" not in given:
        loss = default_loss(model, span)
        return params + (("loss", V.Fn(loss.name)),)
    value, where = given["loss"]
    loss = function(value.name)
    if loss.trains is not model.head:
        if loss.trains is Head.VALUE:
            raise SpecError(f"loss {loss.name} trains a value head; '{model.name}' has head = "
                            f"{model.head.value}", where, hint="add 'head = value' to the model")
        raise SpecError(f"loss {loss.name} trains a policy; '{model.name}' has head = "
                        f"{model.head.value}", where,
                        hint=f"use loss = {default_loss(model, span).name}")
    return params


def default_loss(model: Model, span: Span) -> Function:
    """The first loss in the registry that trains ``model``'s head."""
    loss = loss_for(model.head)
    if loss is None:
        raise SpecError(f"no loss trains a model with head = {model.head.value} ('{model.name}')",
                        span, hint="a reward model is trained outside rpeg; mark it frozen")
    return loss


def _arg_span(decl: ast.StageDecl, name: str) -> Span:
    for a in decl.call.args:
        if isinstance(a, ast.Ident) and a.value == name:
            return a.span
    for k in decl.call.kwargs:
        if isinstance(k.value, ast.Ident) and k.value.value == name:
            return k.value.span
    return decl.span


# --- roles -----------------------------------------------------------------------------

def roles_of(stages, targets) -> dict[str, Role]:
    """Every datum's role: the workload's prompts, and each stage's outputs by its function."""
    out = {d: Role.PROMPTS for d in WORKLOAD_DATA}
    for s in stages:
        model = targets.get(s.target) if s.target else None
        for o, role in zip(s.outputs, output_roles(function(s.function), model), strict=False):
            out[o] = role
    return out


def slots_of(stage: Stage) -> tuple[Slot, ...]:
    """What a stage may read: its function's slots, and for train its loss's."""
    fn = function(stage.function)
    slots = list(fn.inputs)
    if stage.kind is OpKind.TRAIN:
        slots += function(stage.param("loss").name).inputs
    return tuple(slots)


def check_roles(stages: tuple[Stage, ...], items, targets, workload: Workload) -> None:
    decls = {i.name.value: i for i in items if isinstance(i, ast.StageDecl)}
    for s in stages:
        _check_outputs(s, decls[s.name], targets)
    roles = roles_of(stages, targets)
    for s in stages:
        decl = decls[s.name]
        fn = function(s.function)
        data_params = {str(v) for k, v in s.params
                       if fn.has(k) and fn.param(k).type is Type.DATA}
        read: dict[Role, list[str]] = {}
        slots = slots_of(s)
        for name in s.inputs:
            if name in data_params:
                continue
            role = roles[name]
            slot = next((x for x in slots if x.role is role), None)
            if slot is None:
                accepted = ", ".join(dict.fromkeys(x.role.value for x in slots))
                raise SpecError(f"'{name}' must be {accepted} to be read by {fn.name}(...), "
                                f"not {role.what}", _arg_span(decl, name))
            if read.get(role) and not slot.many:
                raise SpecError(f"{fn.name}(...) reads one {role.value}, and '{name}' is a "
                                f"second after '{read[role][0]}'", _arg_span(decl, name))
            read.setdefault(role, []).append(name)
        for slot in slots:
            if slot.required and slot.role not in read:
                raise SpecError(f"{fn.name}(...) must read {slot.role.what}", decl.call.span,
                                hint=_producer_hint(slot.role, roles))
        _check_keywords(s, decl, read, roles)


def _check_refill(s: Stage, decl: ast.StageDecl, stages, targets) -> None:
    """Dynamic sampling scores each round's groups while generating, with the rewards of the
    score stages that read the responses: there must be one, and each a reward (a reward
    model runs on devices of its own, not inside the generate op)."""
    span = _key_span(decl.call, "refill_rounds", function(s.function)) or decl.call.span
    readers = refill_scores(stages, s)
    if not readers:
        raise SpecError(f"refill_rounds must come with a score stage reading "
                        f"'{s.outputs[0]}' that an estimator adds up, to find the groups whose "
                        "rewards are all equal", span,
                        hint=f"add: stage scores = score(REWARD, {s.outputs[0]}) -> scores, read "
                             "by the advantage estimator")
    for x in readers:
        if isinstance(targets.get(x.target), Model):
            raise SpecError(f"refill_rounds must score with rewards, not reward model "
                            f"'{x.target}' (stage '{x.name}'): dynamic sampling scores groups "
                            "inside the generate op", span,
                            hint="score with a python reward, or leave refill_rounds out")


def refill_scores(stages, generate: Stage) -> list[Stage]:
    """The score stages whose rewards dynamic sampling adds up for ``generate``'s groups: those
    reading its responses whose scores an estimator adds up (not as a baseline)."""
    summed = _summed(stages)
    return [x for x in stages if x.kind is OpKind.SCORE and generate.outputs[0] in x.inputs
            and x.outputs[0] in summed]


def _summed(stages) -> set[str]:
    """Data some estimator adds up as scores (not as a baseline)."""
    out: set[str] = set()
    for e in stages:
        fn = function(e.function)
        if fn.category is Category.ESTIMATOR:
            data = {str(v) for k, v in e.params if fn.has(k) and fn.param(k).type is Type.DATA}
            out |= set(e.inputs) - data
    return out


def _check_outputs(s: Stage, decl: ast.StageDecl, targets) -> None:
    fn = function(s.function)
    model = targets.get(s.target) if s.target else None
    produced = output_roles(fn, model)
    if len(s.outputs) > len(produced):
        extra = decl.outputs[len(produced)]
        what = ", ".join(r.value for r in produced)
        raise SpecError(f"{fn.name}(...) must name at most {len(produced)} output"
                        f"{'s' if len(produced) != 1 else ''} ({what}), not {len(s.outputs)}",
                        extra.span, hint=f"remove '{extra.value}'")


def _check_keywords(s: Stage, decl: ast.StageDecl, read, roles) -> None:
    """Keywords that need an input to do anything (or name data of the wrong role)."""
    fn = function(s.function)
    calls = [(fn, dict(s.params), decl.call)]
    if s.kind is OpKind.TRAIN:
        loss = s.param("loss")
        kw = decl.call.kwarg("loss")
        calls.append((function(loss.name), dict(loss.kwargs),
                      kw.value if kw is not None and isinstance(kw.value, ast.Call) else None))
    for f, given, call in calls:
        for key, value in given.items():
            p = f.param(key)
            span = _key_span(call, key, f) or decl.call.span
            if not p.is_set(value):
                continue
            for role in p.needs:
                if p.type is Type.DATA:
                    if roles.get(str(value)) is not role:
                        got = roles.get(str(value))
                        raise SpecError(f"{key} must name {role.what}, not "
                                        f"{got.what if got else 'unknown data'}", span)
                elif role not in read:
                    raise SpecError(f"{key} = {V._fmt(value)} needs {role.what} as an input "
                                    f"of {s.function}(...)", span,
                                    hint=_producer_hint(role, roles) or f"or leave {key} out")


def _key_span(call: ast.Call | None, key: str, fn: Function) -> Span | None:
    if call is None:
        return None
    kw = call.kwarg(key)
    if kw is not None:
        return kw.span
    if key in fn.positional and fn.positional.index(key) < len(call.args):
        return call.args[fn.positional.index(key)].span
    return None


def _check_samples(s: Stage, fn: Function, decl, workload: Workload, wl) -> None:
    need = fn.min_samples
    if fn.has("baseline") and fn.param("baseline").type is Type.CHOICE \
            and s.param("baseline") == "group":
        need = 2
    if s.kind is OpKind.GENERATE and int(s.param("refill_rounds", 0)) > 0:
        need = 2
    if workload.samples < need:
        span = _key_span(decl.call, "refill_rounds", fn) or _key_span(
            decl.call, "baseline", fn) or decl.call.span
        samples = next((e for e in wl.block.entries if not isinstance(e, ast.Section)
                        and e.key.value == "samples"), None)
        raise SpecError(f"{fn.name}(...) needs at least {need} samples per prompt, not "
                        f"{workload.samples}: with one, every group's advantage is 0", span,
                        notes=[("samples set here", samples.span)] if samples else [],
                        hint=f"set samples = {max(need, 4)} in the workload")


def _producer_hint(role: Role, roles: dict[str, Role]) -> str | None:
    have = [d for d, r in roles.items() if r is role]
    if have:
        return f"add {have[0]} to its inputs"
    return {Role.VALUES: "add a stage: forward(CRITIC, responses) -> values, with a model "
                         "that has head = value",
            Role.REF_LOGPROBS: "add a stage: forward(REF, responses) -> ref_logprobs, with a "
                               "frozen model",
            Role.SCORES: "add a stage: score(REWARD, responses) -> scores",
            Role.ADVANTAGES: "add an advantage estimator, such as group_norm(scores) -> "
                             "advantages",
            Role.RETURNS: "gae(...) -> advantages, returns gives returns",
            Role.RESPONSES: "add a stage: generate(MODEL, prompts) -> responses",
            Role.LOGPROBS: "name generate's second output: -> responses, logprobs"}.get(role)


def implicit_inputs(pipeline, stage: Stage) -> tuple[str, ...]:
    """What an estimator reads besides the data it names: the responses its scores are of
    (their groups and lengths), and those a baseline keyword's scores are of (to match the
    baseline to the prompts). The graph builder adds them as inputs of the estimator's op.
    Where the responses are conversations (a generate stage with tools), every estimator
    reads them: which of their tokens are the policy's."""
    fn = function(stage.function)
    if not fn.reads_responses and not _conversations(pipeline):
        return ()
    targets = {m.name: m for m in pipeline.models} | {r.name: r for r in pipeline.rewards}
    roles = roles_of(pipeline.stages, targets)
    data = [str(v) for k, v in stage.params if fn.has(k) and fn.param(k).type is Type.DATA]
    out: list[str] = []
    main = next((n for n in stage.inputs if n not in data
                 and roles.get(n) in (Role.RESPONSES, Role.SCORES)), None)
    for name in ([main] if main else []) + data:
        if roles.get(name) is Role.RESPONSES:
            out.append(name)
            continue
        src = pipeline.producer(name)
        if src is not None and src.inputs:
            out.append(src.inputs[0])
    return tuple(dict.fromkeys(n for n in out if n not in stage.inputs))


def _conversations(pipeline) -> bool:
    from rpeg.spec.tools import multi_turn
    return any(s.kind is OpKind.GENERATE and multi_turn(s) for s in pipeline.stages)
