"""What the torch backend executes: read by the planner and the runtime (values only).

    >>> CAPABILITIES.max_tp, CAPABILITIES.max_pp
    (8, 1)

Training and forward ops: data parallelism (DDP), tensor parallelism up to 8 (DTensor,
within a node). The torch engine generates at the same degrees and keeps partial
rollouts between steps. Models: dense Llama, Qwen2, Qwen3 (its head size and QK-norm) and
Mistral blocks, with LoRA adapters (peft); not mixtures of experts, latent attention, OPT's
plain MLP or FP8. Nothing here imports torch: the compile path reads it.
"""

from rpeg.plan.capabilities import Capabilities, EngineCapabilities
from rpeg.spec.model import Engine

CAPABILITIES = Capabilities(
    backend="torch",
    max_tp=8,
    max_pp=1,
    zero=frozenset({0}),
    recompute=False,
    offload=False,
    packing=False,
    engines=(EngineCapabilities(Engine.TORCH, max_tp=8, carry=True,
                                batching=("max_num_seqs",)),),     # decoded in waves
    batching=True,
    families=frozenset({"llama", "qwen2", "qwen3", "mistral"}),
    model_features=frozenset({"head_dim", "qk_norm"}),      # Qwen3's heads
    lora=True,                                               # adapters with peft, at tp = 1
    missing=(("pp", "pipeline parallelism is not executed"),
             ("zero", "ZeRO sharding is not executed (data parallelism is DDP)"),
             ("recompute", "activation recomputation is not executed"),
             ("offload", "optimizer offload is not executed")),
)
