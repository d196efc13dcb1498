"""What the torch backend executes: read by the planner and the runtime (values only).

    >>> CAPABILITIES.max_tp, CAPABILITIES.max_pp, sorted(map(int, CAPABILITIES.zero))
    (8, 1, [0, 2, 3])

Training and forward ops: data parallelism (DDP, ZeRO 0), FSDP2 sharding (ZeRO 2: gradients
and optimizer state sharded, weights gathered whole between ops; ZeRO 3: everything
sharded), tensor parallelism up to 8 (DTensor, within a node) alone or on a 2-D mesh with
FSDP2, activation recomputation per decoder layer, optimizer state offloaded to host memory
between train ops, and packed sequences (no padding) in token-balanced micro-batches
(``sharding.py``, ``batching.py``). The torch engine generates at the same tensor-parallel
degrees and keeps partial rollouts between steps. Models: dense Llama, Qwen2, Qwen3 (its
head size and QK-norm) and Mistral blocks, with LoRA adapters (peft: at tp = 1 and ZeRO 0,
not under FSDP2); not mixtures of experts, latent attention, OPT's plain MLP or FP8.
Nothing here imports torch: the compile path reads it.
"""

from rpeg.plan.capabilities import Capabilities, EngineCapabilities
from rpeg.spec.model import Engine

CAPABILITIES = Capabilities(
    backend="torch",
    max_tp=8,
    max_pp=1,
    zero=frozenset({0, 2, 3}),
    recompute=True,
    offload=True,
    packing=True,
    engines=(EngineCapabilities(Engine.TORCH, max_tp=8, carry=True,
                                batching=("max_num_seqs",)),),     # decoded in waves
    batching=True,
    families=frozenset({"llama", "qwen2", "qwen3", "mistral"}),
    model_features=frozenset({"head_dim", "qk_norm"}),      # Qwen3's heads
    lora=True,                                               # adapters with peft,
    lora_max_tp=1,                                           # at tp = 1,
    lora_zero=frozenset({0}),                                # whole (DDP), not FSDP2
    eval_zero=frozenset({0, 2}),      # the eval generates with a whole trained replica:
    eval_max_tp=1,                    # ZeRO-3 and tp keep it in pieces
    missing=(("pp", "pipeline parallelism is not executed"),
             ("zero", "ZeRO-1 (optimizer state alone sharded) is not executed; ZeRO-2 and "
                      "ZeRO-3 are, by FSDP2")),
)
