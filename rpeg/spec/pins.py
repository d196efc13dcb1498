"""``place STAGE on gpus A..B { ... }``: a stage pinned to devices, and any part of its layout.

    >>> from rpeg.spec.parser import parse_text
    >>> f = parse_text('''pipeline p
    ... place actor_step on gpus 0..3 { dp = 2; tp = 2; zero = 3; recompute }
    ... ''', "x.rpeg")
    >>> item = f.items[1]
    >>> [e.key.value for e in item.block.entries]
    ['dp', 'tp', 'zero', 'recompute']

What the block may say depends on the stage (``LAYOUT_KEYS``): any model stage its data,
tensor and pipeline parallel degrees, its ``engine``, its ``zero`` level (a forward or
generate stage: ZeRO-3 inference, each pass gathering the sharded weights) and
``param_offload`` (weights in host memory); a generate stage its ``chunks`` and how the
engine batches: ``max_num_seqs`` (sequences at once per replica: vLLM's max_num_seqs, a
static batch's micro-batch), ``kv_fraction`` (the share of GPU memory the engine takes,
vLLM's gpu_memory_utilization) and ``cuda_graph``; a forward or train stage its context
parallel degree ``cp``, expert parallel degree ``ep`` (a mixture of experts),
``microbatches`` and ``packing`` (sequences packed without padding); a train stage
``recompute`` and ``offload`` (the optimizer state in host memory). Flags are written
alone (``recompute``) or as ``recompute = false``. The checker refuses a pin that cannot be laid out whatever the
cluster: degrees whose product is not the pin's device count, a tp that does not divide
the model's heads, a pp above its layers, fewer micro-batches than pipeline stages.
Whether the executor planned for runs a pin (ZeRO levels, pipeline parallelism, ...) is
the planner's question (:mod:`rpeg.plan.pinned`), asked at the same span.
"""

from __future__ import annotations

from rpeg.errors import SpecError, did_you_mean
from rpeg.spec import ast
from rpeg.spec import values as V
from rpeg.spec.keys import MAX_GPU, PLACE, layout_keys, read
from rpeg.spec.model import GENERATE_ENGINES, PASS_ENGINES, Engine, Model, OpKind, Pin, Stage
from rpeg.spec.vocabulary import foreign_hint

DEGREES = ("dp", "tp", "pp", "cp")
# what a stage of each kind may pin (a score stage: one with a reward model)
LAYOUT_KEYS: dict[OpKind, tuple[str, ...]] = {
    k: layout_keys(k) for k in (OpKind.GENERATE, OpKind.FORWARD, OpKind.SCORE, OpKind.TRAIN)}


def lower_place(i: ast.Place, stages: dict[str, Stage], targets: dict) -> Pin:
    """The checked meaning of one ``place`` statement."""
    if i.stage.value not in stages:
        raise SpecError(f"place names unknown stage '{i.stage.value}'", i.stage.span,
                        hint=did_you_mean(i.stage.value, list(stages)))
    lo = V.integer(i.gpus.low, "first gpu", maximum=MAX_GPU)
    hi = V.integer(i.gpus.high, "last gpu", maximum=MAX_GPU)
    if hi < lo:
        raise SpecError(f"gpu range must run low..high, not {lo}..{hi}", i.gpus.span)
    stage = stages[i.stage.value]
    model = targets.get(stage.target or "")
    values, keys = _entries(i.block, stage, model) if i.block is not None else ({}, ())
    pin = Pin(stage.name, lo, hi, span=i.span, keys=keys, **values)
    _check_degrees(pin, stage, model)
    asked = stage.param("engine", Engine.AUTO)
    if pin.engine is not None and asked is not Engine.AUTO and pin.engine is not asked:
        raise SpecError(f"place {stage.name} must use the engine its stage asks for "
                        f"({asked.value}), not {pin.engine.value}", pin.span_of("engine"),
                        notes=[("the stage asks for it here", stage.span)],
                        hint="write the engine in one place")
    return pin


def _entries(block: ast.Block, stage: Stage, model) -> tuple[dict, tuple]:
    allowed = LAYOUT_KEYS.get(stage.kind, ()) if isinstance(model, Model) else ()
    values: dict[str, object] = {}
    keys: list[tuple[str, object]] = []
    for e in block.entries:
        key = e.kind if isinstance(e, ast.Section) else e.key
        if not allowed:
            raise SpecError(f"place {stage.name} may pin only the devices of a stage that "
                            f"runs on the host, not '{key.value}'", key.span,
                            hint=f"write 'place {stage.name} on gpus A..B' without a block")
        if key.value not in allowed:
            raise SpecError(f"the layout of {stage.kind.value} stage '{stage.name}' must be "
                            f"pinned with one of {', '.join(allowed)}, not '{key.value}'",
                            key.span, hint=foreign_hint(key.value, allowed)
                            or did_you_mean(key.value, allowed))
        if key.value in values:
            raise V.duplicate("key", key.value, key.span, dict(keys)[key.value])
        engines = GENERATE_ENGINES if stage.kind is OpKind.GENERATE else PASS_ENGINES
        values[key.value] = _value(e, key.value, engines)
        keys.append((key.value, e.span))
    return values, tuple(keys)


def _value(e: ast.Entry, key: str, engines: tuple[Engine, ...] = tuple(Engine)) -> object:
    if isinstance(e, ast.Section):
        raise SpecError(f"{key} must be set with '{key} = VALUE', not a block", e.span)
    if key == "engine":
        if isinstance(e, ast.Flag):
            raise SpecError(f"{key} must be set with '{key} = VALUE'", e.span)
        return Engine(V.name(e.value, key, tuple(x.value for x in engines)))
    return read(e, PLACE.param(key))


def _check_degrees(pin: Pin, stage: Stage, model) -> None:
    given = {k: getattr(pin, k) for k in DEGREES if getattr(pin, k) is not None}
    product = 1
    for v in given.values():
        product *= v
    where = pin.span_of(next(reversed(given))) if given else pin.span
    words = " x ".join(f"{k} = {v}" for k, v in given.items())
    if {"dp", "tp", "pp"} <= set(given) and product != pin.size:
        names = "dp x tp x pp" + (" x cp" if "cp" in given else "")
        raise SpecError(f"place {stage.name}: {names} must be the {pin.size} GPUs of "
                        f"{pin.first}..{pin.last}, not {words} = {product}", where,
                        hint="make the degrees multiply to the device count, or widen the range")
    if given and pin.size % product:
        raise SpecError(f"place {stage.name}: {words} must divide the {pin.size} GPUs of "
                        f"{pin.first}..{pin.last}, not leave {pin.size % product} over", where,
                        hint="make the degrees divide the device count")
    if not isinstance(model, Model):
        return
    d = model.dims
    if pin.tp is not None:
        tp = pin.tp
        bad = [(what, n) for what, n in (("attention heads", d.heads), ("KV heads", d.kv_heads))
               if (n % tp if tp <= n else tp % n or what == "attention heads")]
        if bad:
            what, n = bad[0]
            ok = [k for k in range(1, d.heads + 1) if d.heads % k == 0
                  and (d.kv_heads % k == 0 if k <= d.kv_heads else k % d.kv_heads == 0)]
            raise SpecError(f"place {stage.name}: tp must divide the {n} {what} of model "
                            f"'{model.name}', not {tp}", pin.span_of("tp"),
                            hint=f"use tp in {ok}")
    if pin.pp is not None and pin.pp > d.layers:
        raise SpecError(f"place {stage.name}: pp must be at most the {d.layers} layers of "
                        f"model '{model.name}', not {pin.pp}", pin.span_of("pp"))
    if pin.ep is not None and pin.ep > 1 and not d.moe:
        raise SpecError(f"place {stage.name}: ep must be 1 for model '{model.name}', which has "
                        f"no experts, not {pin.ep}", pin.span_of("ep"))
    if pin.ep is not None and d.moe and d.experts % pin.ep:
        raise SpecError(f"place {stage.name}: ep must divide the {d.experts} experts of model "
                        f"'{model.name}', not {pin.ep}", pin.span_of("ep"))
    ranks = (pin.dp or 0) * (pin.cp or 1) * (pin.tp or 1)
    if pin.ep is not None and pin.dp is not None and ranks % pin.ep:
        raise SpecError(f"place {stage.name}: ep must divide the dp x cp x tp = {ranks} ranks "
                        f"that hold the experts, not {pin.ep}", pin.span_of("ep"))
    if pin.pp is not None and pin.microbatches is not None and pin.microbatches < pin.pp:
        raise SpecError(f"place {stage.name}: microbatches must be at least pp = {pin.pp} "
                        f"(one per pipeline stage in flight), not {pin.microbatches}",
                        pin.span_of("microbatches"))
