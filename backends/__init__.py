"""Execution backends: the only code in rpeg that touches tensors.

    >>> sorted(NAMES)
    ['torch', 'vllm']
    >>> load("vllm", "available")()[0] in (True, False)
    True

This is rpeg's one table of backends. The runtime reaches a backend only through it:
``load(name, what)`` imports what it asks of backend ``name`` on first use, so a worker that
never generates with vLLM never imports it, and the runtime names no backend module itself.
The planner reads here too, and only ``capabilities``: what each backend executes, declared
as values in a data module of its own that imports neither torch nor vLLM (the compile path
imports this module and nothing else of ``backends``: ``tests/test_layers.py``). Each
backend implements the contracts of ``backends.api``.
"""

from __future__ import annotations

import importlib

from rpeg.errors import BackendError

# what the runtime asks of each backend -> "module:attribute"
_REGISTRY: dict[str, dict[str, str]] = {
    "torch": {
        # what it executes (values only: read by the planner without torch)
        "capabilities": "backends.torch_backend.capabilities:CAPABILITIES",
        "executor": "backends.torch_backend.executor:Executor",     # a device's op runner
        "init_world": "backends.torch_backend.distributed:init_world",
        "shutdown_world": "backends.torch_backend.distributed:shutdown_world",
        "device_report": "backends.torch_backend.distributed:device_report",
        "codec": "backends.torch_backend.tokenizer:codec_for",      # a model's text <-> ids
        "prompt_too_long": "backends.torch_backend.tokenizer:PromptTooLong",
        # a checkpoint's tensors checked against the pipeline's models, before a resume
        "check_checkpoint": "backends.torch_backend.modeling:check_checkpoint",
        # a checkpoint's trained model as a Hugging Face folder (``rpeg export``;
        # backends.api.Exporter)
        "export": "backends.torch_backend.export:export_run",
    },
    "vllm": {
        "capabilities": "backends.vllm_backend.capabilities:CAPABILITIES",   # its engine
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
