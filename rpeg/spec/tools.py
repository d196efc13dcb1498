"""Tools and environments a policy talks to over several turns, and how a generate stage
uses them.

    >>> from rpeg.spec.parser import parse_text
    >>> v = parse_text("x = f(latency = lognormal(median = 2 s, max = 30 s))").items  # doctest: +SKIP
    >>> lat = Latency.lognormal(2.0, 30.0)
    >>> round(lat.median, 1), lat.max, str(lat)
    (2.0, 30.0, 'lognormal(median = 2 s, max = 30 s)')
    >>> round(float(lat.quantiles(4)[0]), 3) < 2.0 < round(float(lat.quantiles(4)[-1]), 3)
    True

``tool NAME = python("module:function", timeout = 5 s, ...)`` declares a function from a
call's argument text to an observation text; ``environment NAME = python("module:Class")``
a class whose instance keeps state across the turns of one sample (``reset``, then
``step`` per turn). A generate stage that names them (``tools = [calc]``, ``environment =
maze``) samples a conversation per prompt: turns of policy tokens, each followed by an
observation (:class:`Conversation`, what its keywords resolve to). Both run outside the
policy's process, in a sandbox with the limits declared here.

The cost model prices a conversation turn by turn: per turn, the prefill of the context
that is new to the engine and the decode of the turn, and per call the tool's declared
``latency`` on the host cores the cluster gives tool executors. ``turns`` and ``obs_len``
are the distributions it prices the turns per sample and the observation tokens per call
by; what runs is capped by ``max_turns``, ``max_obs_len`` and ``max_total_len``.
"""

from __future__ import annotations

import ast as pyast
import functools
import math
from statistics import NormalDist

import attrs
import numpy as np

from rpeg.errors import NOWHERE, Span, SpecError, SpecWarning, did_you_mean
from rpeg.spec import ast
from rpeg.spec import values as V
from rpeg.spec.kinds import DEFAULT_TURNS, FORMATS, ToolFormat
from rpeg.spec.model import LengthDist, LengthKind


@attrs.frozen
class Latency:
    """How long one call takes, in seconds: fixed, uniform or lognormal (``max`` at the
    99.9th percentile unless ``sigma`` is given), always within [``low``, ``max``]."""

    kind: LengthKind
    max: float
    median: float = 0.0
    sigma: float = 0.0
    low: float = 0.0

    @classmethod
    def fixed(cls, s: float) -> Latency:
        return cls(LengthKind.FIXED, max=float(s), median=float(s), low=float(s))

    @classmethod
    def lognormal(cls, median: float, top: float, sigma: float | None = None) -> Latency:
        if sigma is None:
            sigma = math.log(top / median) / 3.09 if top > median else 0.0
        return cls(LengthKind.LOGNORMAL, max=float(top), median=float(median),
                   sigma=float(sigma))

    def quantiles(self, n: int = 64) -> np.ndarray:
        """``n`` durations at evenly spaced quantiles (midpoints)."""
        q = (np.arange(n) + 0.5) / n
        if self.kind is LengthKind.FIXED:
            return np.full(n, self.max)
        if self.kind is LengthKind.UNIFORM:
            return self.low + q * (self.max - self.low)
        z = np.array([NormalDist().inv_cdf(float(x)) for x in q])
        return np.clip(self.median * np.exp(self.sigma * z), self.low, self.max)

    def mean(self) -> float:
        return float(self.quantiles(256).mean())

    def __str__(self) -> str:
        if self.kind is LengthKind.FIXED:
            return f"fixed({_s(self.max)})"
        if self.kind is LengthKind.UNIFORM:
            return f"uniform(min = {_s(self.low)}, max = {_s(self.max)})"
        text = f"lognormal(median = {_s(self.median)}, max = {_s(self.max)}"
        default = math.log(self.max / self.median) / 3.09 if self.max > self.median else 0.0
        if abs(self.sigma - default) > 1e-9:
            text += f", sigma = {self.sigma:g}"
        return text + ")"


MAX_SECONDS = 86400.0


def latency(v: ast.Value, key: str = "latency") -> Latency:
    """A duration (``2 s``) or a distribution of durations: ``fixed(2 s)``, ``uniform(min =
    1 s, max = 3 s)``, ``lognormal(median = 2 s, max = 30 s[, sigma = 0.5])``."""
    if isinstance(v, ast.Number):
        return Latency.fixed(_seconds(v, key))
    if not isinstance(v, ast.Call):
        raise SpecError(f"{key} must be a duration or a distribution such as lognormal(median "
                        f"= 2 s, max = 30 s), not {V.kind_of(v)} ({V.describe(v)})", v.span)
    fn = v.func.value
    allowed = {"fixed": ("s",), "uniform": ("min", "max"),
               "lognormal": ("median", "max", "sigma")}
    if fn not in allowed:
        raise SpecError(f"{key} distribution must be one of {', '.join(allowed)}, not '{fn}'",
                        v.func.span, hint=did_you_mean(fn, allowed))
    given: dict[str, ast.Value] = dict(zip(allowed[fn], v.args, strict=False))
    if len(v.args) > len(allowed[fn]):
        raise SpecError(f"{fn}(...) takes at most {len(allowed[fn])} values", v.args[-1].span)
    for k in v.kwargs:
        if k.key.value not in allowed[fn]:
            forms = {"fixed": "fixed(2 s) or fixed(s = 2 s)",
                     "uniform": "uniform(min = 1 s, max = 3 s)",
                     "lognormal": "lognormal(median = 2 s, max = 30 s)"}
            raise SpecError(f"unknown key '{k.key.value}' in a {key}'s {fn}(...), which takes "
                            f"{', '.join(allowed[fn])}", k.key.span,
                            hint=f"a duration's distribution: {forms[fn]}")
        if k.key.value in given:
            raise SpecError(f"{k.key.value} is given twice", k.key.span)
        given[k.key.value] = k.value

    def need(name: str) -> float:
        if name not in given:
            raise SpecError(f"{fn}(...) needs {name} = ...", v.span)
        return _seconds(given[name], name)
    if fn == "fixed":
        return Latency.fixed(need("s"))
    if fn == "uniform":
        lo, hi = need("min"), need("max")
        if hi < lo:
            raise SpecError(f"uniform max must be at least min ({_s(lo)}), not {_s(hi)}", v.span)
        return Latency(LengthKind.UNIFORM, max=hi, median=(lo + hi) / 2, low=lo)
    median, hi = need("median"), need("max")
    if median <= 0:
        raise SpecError("lognormal median must be positive", given["median"].span)
    if hi < median:
        raise SpecError(f"lognormal max must be at least the median ({_s(median)}), not "
                        f"{_s(hi)}", v.span)
    sigma = V.real(given["sigma"], "sigma", minimum=0.0, maximum=10.0) \
        if "sigma" in given else None
    return Latency.lognormal(median, hi, sigma)


def _seconds(v: ast.Value, key: str) -> float:
    x = V.quantity(v, "s", key)
    if x > MAX_SECONDS:
        raise SpecError(f"{key} must be at most a day, not {V.describe(v)}", v.span)
    return x


def _s(x: float) -> str:
    if x >= 1 or x == 0:
        return f"{x:g} s"
    if x >= 1e-3:
        return f"{x * 1e3:g} ms"
    return f"{x * 1e6:g} us"


@attrs.frozen
class Tool:
    """``tool NAME = python("module:function", ...)`` (``environment`` False) or
    ``environment NAME = python("module:Class", ...)``: the code and the sandbox it runs in."""

    name: str
    module: str
    function: str                 # a function (tool) or a class (environment)
    span: Span = NOWHERE
    environment: bool = False
    timeout: float = 5.0          # seconds of wall-clock time one call may take
    memory: float = 1e9           # bytes one call may allocate
    max_output: float = 65536.0   # bytes of text one call may return
    cores: int = 1                # host cores one call takes
    latency: Latency | None = None    # declared; None: the profile's measured call time
    kind: str = "python"
    source: str = ""              # the module's file, found when the spec was loaded
    folder: str = ""              # the folder of the file naming it: imported from there

    @property
    def ref(self) -> str:
        return f"{self.module}:{self.function}"

    def __str__(self) -> str:
        keys = [f"timeout = {_s(self.timeout)}"]
        if self.latency is not None:
            keys.append(f"latency = {self.latency}")
        return f'{self.kind}("{self.ref}", {", ".join(keys)})'


@attrs.frozen
class Conversation:
    """What a generate stage's tool keywords resolve to (:func:`conversation`)."""

    tools: tuple[str, ...] = ()
    environment: str | None = None
    max_turns: int = 4
    format: ToolFormat = ToolFormat.RPEG
    max_obs_len: int = 256
    max_total_len: int = 0
    turns: LengthDist = LengthDist.fixed(4)      # policy turns per sample, as priced
    obs_len: LengthDist = LengthDist.fixed(256)  # observation tokens per call, as priced

    @property
    def declared(self) -> tuple[str, ...]:
        """Every tool and environment it names."""
        return self.tools + ((self.environment,) if self.environment else ())


TURN_KEYS = ("tools", "environment", "max_turns", "format", "max_obs_len", "max_total_len",
             "turns", "obs_len")


def multi_turn(stage) -> bool:
    """Whether a generate stage talks to tools or an environment."""
    return bool(stage.param("tools")) or stage.param("environment") is not None


def conversation(stage, max_len: int) -> Conversation | None:
    """The conversation a generate stage samples (None: one response per sample), its
    caps resolved: ``max_len`` is its tokens per turn (its own max_len, else the workload's)."""
    if not multi_turn(stage):
        return None
    turns = int(stage.param("max_turns") or DEFAULT_TURNS)
    obs = int(stage.param("max_obs_len") or stage.arg("max_obs_len"))
    total = int(stage.param("max_total_len") or turns * (max_len + obs))
    dist = stage.param("turns") or LengthDist.fixed(turns)
    obs_dist = stage.param("obs_len") or LengthDist.fixed(obs)
    return Conversation(tuple(stage.param("tools") or ()), stage.param("environment"), turns,
                        ToolFormat(stage.arg("format")), obs, total,
                        dist.capped(1, turns), obs_dist.capped(1, obs))


@functools.lru_cache(maxsize=256)
def trajectory_len(turn_len: LengthDist, conv: Conversation) -> LengthDist:
    """Tokens of a whole conversation after its prompt, policy and observation tokens: the
    sum of ``turns`` turns of ``turn_len`` tokens and one observation after each turn but the
    last, at most ``max_total_len`` -- what a forward or train op over it computes. A
    deterministic sample of the three distributions, as an empirical distribution."""
    rng = np.random.default_rng(0)
    n = 4096
    t = conv.turns.sample(rng, n)
    per_turn = turn_len.sample(rng, n * conv.max_turns).reshape(n, conv.max_turns)
    obs = conv.obs_len.sample(rng, n * conv.max_turns).reshape(n, conv.max_turns)
    k = np.arange(conv.max_turns)[None, :]
    total = (per_turn * (k < t[:, None])).sum(1) + (obs * (k < t[:, None] - 1)).sum(1)
    total = np.clip(total, 1, conv.max_total_len)
    lengths, counts = np.unique(total, return_counts=True)
    return LengthDist(LengthKind.EMPIRICAL, max_len=int(conv.max_total_len),
                      bins=tuple((int(a), float(b)) for a, b in zip(lengths, counts,
                                                                      strict=True)),
                      source="conversation")


# --- the code a declaration names, read without running it ---------------------------------

def check_signature(tool: Tool, tree: pyast.Module, source: str, span: Span) -> None:
    """The function (tool) or class (environment) the declaration names, as its source
    defines it: a tool takes the call's argument text as its one required argument; an
    environment's class has ``step(self, action)`` (and ``reset`` takes at most a prompt and
    the dataset row)."""
    defs = {n.name: n for n in tree.body
            if isinstance(n, (pyast.FunctionDef, pyast.AsyncFunctionDef, pyast.ClassDef))}
    node = defs.get(tool.function)
    if node is None:
        return                      # imported or assigned: checked when the sandbox loads it
    what = "environment" if tool.environment else "tool"
    if tool.environment:
        if not isinstance(node, pyast.ClassDef):
            raise SpecError(f"environment '{tool.name}' must name a class with reset and step, "
                            f"not function '{tool.function}' ({source})", span,
                            hint="a function from argument text to observation text is a tool: "
                                 f"tool {tool.name} = python(\"{tool.ref}\")")
        methods = {n.name: n for n in node.body if isinstance(n, pyast.FunctionDef)}
        if "step" not in methods:
            raise SpecError(f"environment class '{tool.function}' ({source}) must define "
                            "step(self, action)", span,
                            hint="step takes the policy's turn text and returns the "
                                 "observation text, or (observation, done)")
        _check_args(methods["step"], 2, 2, f"{tool.function}.step", source, span,
                    "step(self, action)")
        if "reset" in methods:
            _check_args(methods["reset"], 1, 3, f"{tool.function}.reset", source, span,
                        "reset(self, prompt, row)")
        if "__init__" in methods:               # the sandbox makes one per sample, bare
            _check_args(methods["__init__"], 1, 1, f"{tool.function}.__init__", source, span,
                        "__init__(self)")      # one for each sample, with no arguments
        return
    if isinstance(node, pyast.ClassDef) or isinstance(node, pyast.AsyncFunctionDef):
        kind = "a class" if isinstance(node, pyast.ClassDef) else "an async function"
        raise SpecError(f"{what} '{tool.name}' must name a function of the argument text, not "
                        f"{kind} ('{tool.function}' in {source})", span,
                        hint="a class with reset and step is an environment: environment "
                             f"{tool.name} = python(\"{tool.ref}\")"
                        if isinstance(node, pyast.ClassDef) else "define it with def")
    _check_args(node, 1, 1, tool.function, source, span, f"{tool.function}(text)")


def _check_args(fn: pyast.FunctionDef, low: int, high: int, name: str, source: str,
                span: Span, form: str) -> None:
    """``fn`` can be called with between ``low`` and ``high`` positional arguments."""
    a = fn.args
    positional = a.posonlyargs + a.args
    required = len(positional) - len(a.defaults)
    kw_required = [k.arg for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None]
    takes = len(positional) if a.vararg is None else math.inf
    if required > high or takes < low or kw_required:
        needs = f"{required} positional argument{'s' if required != 1 else ''}" \
            if not kw_required else f"keyword argument {kw_required[0]}"
        raise SpecError(f"'{name}' in {source} must be callable as {form}, and it needs "
                        f"{needs}", span, hint=f"define it as def {form}")


__all__ = ["Conversation", "FORMATS", "Latency", "Tool", "ToolFormat", "check_signature",
           "conversation", "multi_turn", "trajectory_len"]


# --- a generate stage's conversation, checked ----------------------------------------------

def check_conversations(stages, tools: tuple[Tool, ...], items, workload,
                        warnings: list) -> None:
    """Each generate stage's tool keywords: the tools and environment it names are declared
    as such, the turn keys come with one of them, the priced distributions fit the caps;
    every declared tool is used (else a warning)."""
    from rpeg.spec.kinds import OpKind
    by_name = {t.name: t for t in tools}
    decls = {i.name.value: i for i in items if isinstance(i, ast.StageDecl)}
    used: set[str] = set()
    for s in stages:
        if s.kind is not OpKind.GENERATE:
            continue
        call = decls[s.name].call
        if not multi_turn(s):
            for key in TURN_KEYS[2:]:
                kw = call.kwarg(key)
                if kw is not None:
                    raise SpecError(f"{key} must come with tools or an environment in "
                                    "generate(...), not alone: without them, it does nothing",
                                    kw.span, hint="add tools = [NAME] (a tool NAME = "
                                                  "python(...) declared in the spec)")
            continue
        for name in s.param("tools") or ():
            _declared(name, by_name, False, call, "tools")
        env = s.param("environment")
        if env is not None:
            _declared(env, by_name, True, call, "environment")
            if s.param("tools"):               # an environment's step answers every turn
                raise SpecError("generate(...) takes tools or an environment, not both: an "
                                "environment answers every turn, so no tool would be called",
                                call.kwarg("tools").span,
                                hint="give the environment's step the tools' work, or drop "
                                     "environment = ...")
        elif int(s.param("max_turns") or DEFAULT_TURNS) < 2:
            warnings.append(SpecWarning(
                "max_turns = 1 with tools: the conversation ends after its first turn, before "
                "any call it makes can run", call.kwarg("max_turns").span,
                hint="max_turns = 2 or more lets a turn's call be answered"))
        used |= set(s.param("tools") or ()) | ({env} if env else set())
        if s.arg("refill_rounds"):
            raise SpecError("refill_rounds must generate single responses, not conversations "
                            "with tools", call.kwarg("refill_rounds").span,
                            hint="leave refill_rounds out of a generate stage with tools")
        conv = conversation(s, int(s.arg("max_len") or workload.gen_len.max_len))
        for key, dist, cap, what in (("turns", s.param("turns"), conv.max_turns, "max_turns"),
                                     ("obs_len", s.param("obs_len"), conv.max_obs_len,
                                      "max_obs_len")):
            if dist is not None and dist.max_len > cap:
                raise SpecError(f"{key} must lie within {what} ({cap}), not reach "
                                f"{dist.max_len}", call.kwarg(key).span,
                                hint=f"raise {what}, or lower {key}'s max")
    for t in tools:
        if t.name not in used:
            warnings.append(SpecWarning(f"{'environment' if t.environment else 'tool'} "
                                        f"'{t.name}' is declared but no generate stage uses "
                                        "it", t.span))


def _declared(name: str, by_name: dict[str, Tool], environment: bool, call: ast.Call,
              key: str) -> None:
    kw = call.kwarg(key)
    span = kw.value.span if kw is not None else call.span
    if kw is not None and isinstance(kw.value, ast.ListValue):
        span = next((x.span for x in kw.value.items if isinstance(x, ast.Ident)
                     and x.value == name), span)
    what = "environment" if environment else "tool"
    t = by_name.get(name)
    if t is None:
        raise SpecError(f"unknown {what} '{name}'", span,
                        hint=did_you_mean(name, [n for n, x in by_name.items()
                                                 if x.environment == environment])
                        or f"declare it: {what} {name} = python(\"module:"
                           f"{'Class' if environment else 'function'}\")")
    if t.environment != environment:
        other = "environment" if t.environment else "tool"
        raise SpecError(f"'{name}' is {'an' if other == 'environment' else 'a'} {other}, and "
                        f"{key} names {what}s", span,
                        notes=[(f"declared as {other} here", t.span)],
                        hint=f"use {'environment' if t.environment else 'tools'} = "
                             f"{name if t.environment else '[' + name + ']'}")
