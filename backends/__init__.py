"""Execution backends: the only code in rpeg that touches tensors.

    >>> sorted(NAMES)
    ['torch', 'vllm']
    >>> load("vllm", "available")()[0] in (True, False)
    True

The runtime reaches a backend only through this registry: ``load(name, what)`` imports
what it asks of backend ``name`` on first use, so a worker that never generates with vLLM
never imports it, and the runtime names no backend module itself. Each backend also
declares what it executes in ``backends.<name>_backend.capabilities`` (the planner reads
those as data) and implements the engine contract in ``backends.api``.
"""

from __future__ import annotations

import importlib

from rpeg.errors import BackendError

# what the runtime asks of each backend -> "module:attribute"
_REGISTRY: dict[str, dict[str, str]] = {
    "torch": {
        "executor": "backends.torch_backend.executor:Executor",     # a device's op runner
        "init_world": "backends.torch_backend.distributed:init_world",
        "shutdown_world": "backends.torch_backend.distributed:shutdown_world",
        "device_report": "backends.torch_backend.distributed:device_report",
        "codec": "backends.torch_backend.tokenizer:codec_for",      # a model's text <-> ids
        "prompt_too_long": "backends.torch_backend.tokenizer:PromptTooLong",
        # a checkpoint's tensors checked against the pipeline's models, before a resume
        "check_checkpoint": "backends.torch_backend.modeling:check_checkpoint",
    },
    "vllm": {
        "available": "backends.vllm_backend:available",             # (importable, why not)
        "dask_config": "backends.vllm_backend.host:vllm_dask_config",
    },
}
NAMES = tuple(_REGISTRY)


def load(name: str, what: str):
    """``what`` of backend ``name`` (see ``_REGISTRY``), imported on first use."""
    entries = _REGISTRY.get(name)
    if entries is None:
        raise BackendError(f"backend must be one of {', '.join(NAMES)}, not {name!r}")
    if what not in entries:
        raise BackendError(f"backend {name!r} must provide one of {', '.join(entries)}, "
                           f"not {what!r}")
    module, attribute = entries[what].split(":")
    return getattr(importlib.import_module(module), attribute)
