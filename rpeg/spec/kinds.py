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
