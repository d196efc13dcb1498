"""The kinds a stage, a head and an engine can be: enums every layer names, with no
dependency of their own (``rpeg.spec.model`` re-exports them, and the function registry
reads them without importing the model)."""

from __future__ import annotations

import enum


class OpKind(enum.Enum):
    GENERATE = "generate"
    FORWARD = "forward"
    SCORE = "score"
    COMPUTE = "compute"
    TRAIN = "train"
    SYNC_WEIGHTS = "sync_weights"


class Head(enum.Enum):
    LM = "lm"
    VALUE = "value"
    REWARD = "reward"


class Engine(enum.Enum):
    """Who executes a stage. rpeg's own runtime: ``torch`` (training, inference, generation)
    and ``vllm`` (generation). The others are models of other systems' engines, for pricing
    a configuration as another system ran it (a pinned layout, ``rpeg compile
    --any-executor``): ``hf`` (transformers' ``generate``: a static batch padded to its
    longest), ``hybrid`` (DeepSpeed-Chat's Hybrid Engine: ZeRO-3 weights gathered into
    inference kernels once a step), ``deepspeed`` (DeepSpeed ZeRO training and inference)
    and ``megatron`` (Megatron-style training and inference)."""

    AUTO = "auto"
    TORCH = "torch"
    VLLM = "vllm"
    HF = "hf"
    HYBRID = "hybrid"
    DEEPSPEED = "deepspeed"
    MEGATRON = "megatron"


class Zero(enum.IntEnum):
    """A ZeRO level: which parts of a trained model's state its data-parallel ranks shard
    rather than each hold whole. Levels nest (each shards what the one below does, and one
    thing more); plan files, specs and run records write the level's number.

        >>> Zero.of(2).shards_grads, Zero.of(2).shards_params, str(Zero.WEIGHTS)
        (True, False, '3')
    """

    NONE = 0            # every rank holds everything (DDP)
    OPTIMIZER = 1       # the optimizer state sharded
    GRADIENTS = 2       # ... and the gradients (FSDP2 keeping gathered weights to backward)
    WEIGHTS = 3         # ... and the weights (FSDP2 resharding after each pass)

    @classmethod
    def of(cls, level: object) -> Zero:
        """``level`` (a Zero or its number) as a Zero; ValueError for anything else."""
        if type(level) is cls:
            return level
        if isinstance(level, bool) or not isinstance(level, int) or level not in _LEVELS:
            raise ValueError(f"zero must be a ZeRO level 0..3, not {level!r}")
        return cls(level)

    @classmethod
    def maybe(cls, level: object) -> Zero | None:
        """``of``, with None kept (a key a pin leaves to the planner)."""
        return None if level is None else cls.of(level)

    @property
    def replicated(self) -> bool:
        """Every data-parallel rank holds the whole state: nothing sharded."""
        return self is Zero.NONE

    @property
    def shards_optimizer(self) -> bool:
        return self is not Zero.NONE

    @property
    def shards_grads(self) -> bool:
        return self in (Zero.GRADIENTS, Zero.WEIGHTS)

    @property
    def shards_params(self) -> bool:
        """The weights themselves are sharded: a pass gathers them, nothing reads them whole
        between passes."""
        return self is Zero.WEIGHTS

    @property
    def keeps_gathered(self) -> bool:
        """Gradients sharded, weights whole between forward and backward (ZeRO-2: FSDP2
        without resharding after the forward)."""
        return self is Zero.GRADIENTS


_LEVELS = frozenset(z.value for z in Zero)


def zero_levels(levels) -> frozenset[Zero]:
    """A set of ZeRO levels (numbers or Zeros) as Zeros."""
    return frozenset(Zero.of(z) for z in levels)


GENERATE_ENGINES = (Engine.AUTO, Engine.TORCH, Engine.VLLM, Engine.HF, Engine.HYBRID)
PASS_ENGINES = (Engine.TORCH, Engine.DEEPSPEED, Engine.MEGATRON)    # forward and train


class ToolFormat(enum.Enum):
    """How a tool call is written in a policy's turn, and how its observation is wrapped.

    ``rpeg``: ``<NAME>ARGUMENT</NAME>``, answered by ``<result>TEXT</result>`` (a turn ends at
    a call's closing tag). ``hermes``: the ChatML tool calls of Qwen2.5, Qwen3, SmolLM and
    Hermes (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, answered in a user
    turn's ``<tool_response>``). ``llama3``: Llama 3.1-3.3's JSON calls (``{"name": ...,
    "parameters": {...}}``, answered in an ``ipython`` turn). ``mistral``: ``[TOOL_CALLS]
    [{"name": ..., "arguments": {...}}]``, answered by ``[TOOL_RESULTS]...[/TOOL_RESULTS]``.
    A JSON call's argument text is its arguments object as JSON."""

    RPEG = "rpeg"
    HERMES = "hermes"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"


FORMATS = tuple(f.value for f in ToolFormat)

DEFAULT_TURNS = 4          # a conversation's turns when max_turns is not given
