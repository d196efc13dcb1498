"""What a registry entry is: a function of the language, its keywords, roles and pricing.

    >>> from rpeg.spec.functions import function
    >>> gae = function("gae")
    >>> gae.kind.value, [s.role.value for s in gae.inputs][:2], gae.scope.value
    ('compute', ['scores', 'values'], 'sample')
    >>> gae.param("lam").default, gae.param("lam").range_text()
    (0.95, '[0, 1]')

Every stage function (generate, forward, score, train), advantage estimator, loss,
reward kind and optimizer the language accepts is one :class:`Function` in
``rpeg.spec.functions``. The checker validates calls against it (keywords, their
types and ranges, the roles of inputs and outputs), the graph builder reads its
scope, the cost model its pricing, the planner whether a loss is a policy loss,
and the backends find their implementation of it by its name. ``rpeg help
functions`` prints it (:mod:`rpeg.spec.reference`).

Data flowing between stages has a :class:`Role`, given by the function that
produces it; a function's inputs are slots of roles, so "a forward with no input
sequence" or "an estimator missing the values it needs" are one check, not one
per function.
"""

from __future__ import annotations

import enum
import math

import attrs

from rpeg.spec.kinds import Head, OpKind


class Role(enum.Enum):
    """What a datum is, whatever its name in the spec."""

    PROMPTS = "prompts"
    RESPONSES = "responses"
    LOGPROBS = "logprobs"            # the policy's per-token log-probabilities of the responses
    REF_LOGPROBS = "ref_logprobs"    # a frozen reference model's
    VALUES = "values"                # a value head's per-token estimates
    SCORES = "scores"                # one reward per response
    ADVANTAGES = "advantages"
    RETURNS = "returns"

    @property
    def what(self) -> str:
        return _ROLE_TEXT[self]


_ROLE_TEXT = {
    Role.PROMPTS: "the workload's prompts",
    Role.RESPONSES: "generated responses (a generate stage's first output)",
    Role.LOGPROBS: "the policy's per-token log-probabilities (generate's second output, or a "
                   "forward of a trained language model)",
    Role.REF_LOGPROBS: "a frozen reference model's per-token log-probabilities (a forward of a "
                       "frozen language model)",
    Role.VALUES: "per-token value estimates (a forward of a model with head = value)",
    Role.SCORES: "one reward per response (a score stage, or a forward of a model with "
                 "head = reward)",
    Role.ADVANTAGES: "advantages (an advantage estimator's first output)",
    Role.RETURNS: "value targets (gae's second output)",
}


class Category(enum.Enum):
    STAGE = "stage function"
    ESTIMATOR = "advantage estimator"
    LOSS = "loss"
    REWARD = "reward"
    OPTIMIZER = "optimizer"
    TOOL = "tool"
    ENVIRONMENT = "environment"


class Target(enum.Enum):
    """What a function's first argument names."""

    NONE = "none"                    # pure compute: no model
    LM = "a language model"          # generate
    MODEL = "a model"                # forward
    SCORER = "a reward, or a model with head = reward"
    TRAINABLE = "a trainable model"  # train


class Scope(enum.Enum):
    """What one call of an op must see at once."""

    SAMPLE = "sample"      # response by response: streams generated chunks
    GROUP = "group"        # every sample of a prompt: waits for the step's responses
    BATCH = "batch"        # the whole step's batch: waits for the step's responses


class Pricing(enum.Enum):
    """How the cost model prices a function (rpeg.cost.stages)."""

    GENERATION = "prefill, then one decode step per generated token; finished responses leave " \
                 "the batch"
    MODEL_PASS = "one forward pass over prompt + response per response"
    TRAINING = "forward + backward per optimizer step (minibatches x epochs), gradient " \
               "reduction, the optimizer's step"
    SCORING = "a python reward: per call, per response and per response token (host); a " \
              "reward model: a forward pass"
    PER_TOKEN = "host work per call, per response and per response token"
    PER_SAMPLE = "host work per call and per response"
    IN_TRAINING = "part of its train op (a policy loss with an off-policy correction adds a " \
                  "forward pass without gradients)"
    HOST = "host work per response, inside its score op"
    OPTIMIZER = "the optimizer's step, inside its train op"
    TOOL = "each call its declared latency (rpeg calibrate --tools measures it), on the host " \
           "cores the cluster gives tool executors, inside its generate op"

    @property
    def per_token(self) -> bool:
        return self in (Pricing.PER_TOKEN, Pricing.SCORING)


class Type(enum.Enum):
    INT = "integer"
    REAL = "number"
    BOOL = "true or false"
    CHOICE = "name"
    CALL = "call"          # a loss: ppo_clip(0.2)
    DATA = "data name"     # another stage's output, read as an input
    STRING = "string"
    # Keys of the blocks (rpeg.spec.keys):
    NAME = "declared name"                 # of something the spec declares (a reward)
    FLAG = "flag"                          # written alone, or = true | false
    QUANTITY = "quantity"                  # a number with a unit: 80 GB, 25 GB/s, 5 us
    LENGTH = "length or distribution"      # 512, or lognormal(median = 512, max = 2048)
    NAMES = "list of names"                # [tensorboard, wandb]
    BLOCK = "block"                        # a section of its own: link gpu { ... }
    LATENCY = "distribution of durations"  # lognormal(median = 2 s, max = 30 s)


@attrs.frozen
class Param:
    """One keyword: its type, range, default, unit and meaning.

    ``default`` None means off, or derived from elsewhere (``derived`` says from what).
    ``needs``: input roles the function must read when this keyword is set to anything but
    its default. ``requires``: another keyword that must be set too, or this one does
    nothing (``kl_estimator`` without ``kl``). ``priced``: the cost model reads it (else
    only the executor does)."""

    name: str
    type: Type
    doc: str
    default: object = None
    unit: str = ""
    low: float | None = None
    high: float | None = None
    low_open: bool = False           # (low, ...: low itself is excluded
    high_open: bool = False
    choices: tuple[str, ...] = ()
    needs: tuple[Role, ...] = ()
    requires: str | None = None
    derived: str = ""
    priced: bool = False
    off: object = None               # the value that means "off" when default is derived
    required: bool = False           # a block's key that must be given
    example: str = ""                # a value as written in a spec, where none is derived
    applies: tuple[str, ...] = ()    # a place key: the kinds of stage it may pin

    def in_range(self, x: float) -> bool:
        if self.low is not None and (x < self.low or (self.low_open and x == self.low)):
            return False
        return not (self.high is not None and (x > self.high or (self.high_open
                                                                 and x == self.high)))

    def range_text(self) -> str:
        """The declared range as an interval: ``[0, 1]``, ``(0, 1)``, ``>= 1``."""
        if self.type is Type.CHOICE:
            return " | ".join(self.choices)
        if self.type is Type.BOOL:
            return "true | false"
        if self.type in (Type.NAMES, Type.CALL) and self.choices:
            return " | ".join(self.choices)
        if self.low is None and self.high is None:
            return ""
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {_num(self.high)}"
        return (f"{'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}"
                f"{')' if self.high_open else ']'}")

    def default_text(self) -> str:
        if self.required:
            return "required"
        if self.derived:
            return self.derived
        if self.default is None:
            return "off"
        if isinstance(self.default, bool):
            return "true" if self.default else "false"
        if isinstance(self.default, enum.Enum):
            return str(self.default.value)
        return _num(self.default) if isinstance(self.default, (int, float)) else str(self.default)

    def is_set(self, value: object) -> bool:
        """Whether ``value`` asks for anything but the default (or, for a derived default,
        anything but off)."""
        if self.derived:
            return value is not None and value != self.off
        if value is None:
            return False
        return value != self.default


@attrs.frozen
class Slot:
    """An input of a function: data of ``role``; ``many``: several may be given (scores
    of several score stages, added up with each stage's weight)."""

    role: Role
    required: bool = True
    many: bool = False


@attrs.frozen
class Rule:
    """A precondition of a function or a section: what must hold for what it says to take
    effect. Its check (``rpeg.spec.rules.CHECKS``, ``rpeg.spec.checks.SECTION_CHECKS``, by
    ``name``) returns the SpecError at the text that breaks it (a SpecWarning where a run
    still means something), or None. ``name`` names its golden error
    (tests/fixtures/errors/rules/NAME.rpeg)."""

    name: str
    doc: str


@attrs.frozen
class Function:
    """One entry of the registry (see the module doc)."""

    name: str
    category: Category
    doc: str
    params: tuple[Param, ...] = ()
    kind: OpKind | None = None            # the op kind of a stage it is the function of
    target: Target = Target.NONE
    inputs: tuple[Slot, ...] = ()
    outputs: tuple[Role, ...] = ()        # in order; a stage names the first one or more
    outputs_from_head: bool = False       # forward: what it outputs depends on the model's head
    pricing: Pricing = Pricing.PER_SAMPLE
    scope: Scope = Scope.SAMPLE
    min_samples: int = 1                  # responses per prompt the estimator needs
    positional: tuple[str, ...] = ()      # keywords that may be given by position, in order
    trains: Head | None = None            # a loss: the head it trains
    policy: bool = False                  # a policy-gradient loss (off-policy correction)
    reads_responses: bool = False         # an estimator: reads the responses its scores are of
    user_code: bool = False               # a reward: names the user's python function
    moved: tuple[tuple[str, str], ...] = ()   # keywords it no longer takes: (key, where now)
    signature: str = ""                   # as written in the reference, when not derived
    rules: tuple[Rule, ...] = ()          # preconditions of a call (rpeg.spec.rules)

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"{self.name}(...) has no keyword {name!r}")

    def has(self, name: str) -> bool:
        return any(p.name == name for p in self.params)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def slot(self, role: Role) -> Slot | None:
        return next((s for s in self.inputs if s.role is role), None)

    def resolve(self, given: dict[str, object]) -> dict[str, object]:
        """Every keyword's value: the given ones, the rest their defaults (derived ones None)."""
        return {p.name: given.get(p.name, None if p.derived else p.default) for p in self.params}

    def moved_hint(self, key: str) -> str | None:
        return dict(self.moved).get(key)


def output_roles(fn: Function, model=None) -> tuple[Role, ...]:
    """The roles of what a stage of ``fn`` outputs, in order; a forward's depend on its
    model's head (a frozen language model gives reference logprobs)."""
    if not fn.outputs_from_head:
        return fn.outputs
    if model is None:
        return ()
    if model.head is Head.VALUE:
        return (Role.VALUES,)
    if model.head is Head.REWARD:
        return (Role.SCORES,)
    return (Role.REF_LOGPROBS if model.frozen else Role.LOGPROBS,)


def _num(x: float) -> str:
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"
