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
