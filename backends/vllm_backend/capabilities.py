"""What the vLLM engine executes inside rpeg's runtime (values only; imports no vLLM).

    >>> CAPABILITIES.max_tp, CAPABILITIES.carry
    (8, True)

Engines on devices of their own (disaggregated) or beside the trainer (colocated), at
tensor parallelism up to 8 (vLLM's own, within a node; its workers span the block),
several replicas of it sharing a step's prompts (data parallelism). An engine at tp 1
beside its model's unsplit trained replica is updated from it in memory; every other one
serves a copy of its own that each version reaches through collectives from the trainer
(``backends.vllm_backend.sync``). Partial rollouts: responses unfinished at a step's cut are stopped and
continued in the next step under the new weights (``VllmEngine.generate_carried``), and
the carried buffer is checkpointed.
"""

from rpeg.plan.capabilities import EngineCapabilities
from rpeg.spec.model import Engine

# What a plan leaves unset runs as vLLM is started here (``engine.VllmOptions``): half of a
# GPU (gpu_memory_utilization), or 1 GiB of KV cache on a CPU, decoded eagerly.
CAPABILITIES = EngineCapabilities(Engine.VLLM, max_tp=8, carry=True,
                                  batching=("max_num_seqs", "kv_fraction", "cuda_graph"),
                                  kv_fraction=0.5, cpu_kv_bytes=1 << 30)
