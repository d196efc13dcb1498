"""What the vLLM engine executes inside rpeg's runtime (values only; imports no vLLM).

    >>> CAPABILITIES.max_tp, CAPABILITIES.carry
    (1, False)

One engine per device, beside the torch replica it serves (``colocated``): tensor
parallelism 1, whole responses each step.
"""

from rpeg.plan.capabilities import EngineCapabilities
from rpeg.spec.model import Engine

CAPABILITIES = EngineCapabilities(Engine.VLLM, max_tp=1, carry=False)
