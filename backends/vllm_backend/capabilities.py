"""What the vLLM engine executes inside rpeg's runtime (values only; imports no vLLM).

    >>> CAPABILITIES.max_tp, CAPABILITIES.carry
    (1, True)

One engine per device, beside the torch replica it serves (``colocated``): tensor
parallelism 1. Partial rollouts: responses unfinished at a step's cut are stopped and
continued in the next step under the new weights (``VllmEngine.generate_carried``), and
the carried buffer is checkpointed.
"""

from rpeg.plan.capabilities import EngineCapabilities
from rpeg.spec.model import Engine

CAPABILITIES = EngineCapabilities(Engine.VLLM, max_tp=1, carry=True)
