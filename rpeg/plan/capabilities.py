"""What rpeg's runtime executes: one declaration, read by the planner and the runtime alike.

    >>> caps = runtime_capabilities()
    >>> caps.max_pp, caps.engine(Engine.VLLM).max_tp, caps.engine(Engine.VLLM).carry
    (1, 8, True)
    >>> caps.engine(Engine.TORCH).carry
    True

Each execution backend declares what it executes once, as values in a data module of
its own (``backends/<name>_backend/capabilities.py``: attrs values and nothing else, so
reading it imports neither torch nor vLLM). The training backend declares the parallel
degrees, ZeRO levels, recomputation, offload and packing it runs; each generation
backend declares its engine (the tensor-parallel degree it generates at, whether it
carries responses into later steps). :func:`runtime_capabilities` joins them into one
:class:`Capabilities`, which :meth:`rpeg.plan.space.Limits.runtime` turns into the
planner's limits, ``rpeg compile`` plans for by default, and the runtime's refusals
(``rpeg.runtime.plans``, ``rpeg.runtime.lowering.instances``) read.

What the declaration says does not depend on what is installed on the machine that
plans: planning a GPU cluster from a laptop without vLLM gives the plan a machine with
vLLM gives. Only ``rpeg run``, which executes here, asks which engines are installed.
"""

from __future__ import annotations

import importlib

import attrs

from rpeg.spec.model import Engine

# The backends rpeg's runtime is made of: the training backend first, then the generation
# engines; each name is ``backends.<name>_backend.capabilities``.
RUNTIME_BACKENDS = ("torch", "vllm")


@attrs.frozen
class EngineCapabilities:
    """What one generation engine executes."""

    engine: Engine
    max_tp: int = 1                 # tensor-parallel degree it generates at, at most
    carry: bool = False             # partial rollouts: responses kept between steps
    # a generate stage's batching keys it runs as a plan sets them (max_num_seqs,
    # kv_fraction, cuda_graph); a plan setting another is refused
    batching: tuple[str, ...] = ()
    kv_fraction: float = 0.0        # share of a GPU it takes when a plan leaves it (0: what is free)
    cpu_kv_bytes: int = 0           # on a CPU: bytes of KV cache it takes when a plan leaves it


@attrs.frozen
class Capabilities:
    """What an executor runs. ``missing`` names what the cost model prices and it lacks,
    with the reason, for the notes that say why a plan cannot run."""

    backend: str
    max_dp: int = 1 << 20
    max_tp: int = 1                          # train / forward ops
    max_pp: int = 1
    zero: frozenset[int] = frozenset({0})    # ZeRO levels of train ops
    recompute: bool = False                  # activation checkpointing in train ops
    offload: bool = False                    # optimizer state in host memory between steps
    packing: bool = False                    # forward / train without padding
    engines: tuple[EngineCapabilities, ...] = ()
    missing: tuple[tuple[str, str], ...] = ()
    max_cp: int = 1                          # context (sequence) parallel degree
    max_ep: int = 1                          # expert parallel degree
    param_offload: bool = False              # weights in host memory between passes
    inference_zero: bool = False             # forward / generate on ZeRO-3-sharded weights
    batching: bool = False                   # generate: max_num_seqs, kv_fraction, cuda_graph
                                             # (each engine says which: EngineCapabilities)
    families: frozenset[str] = frozenset()   # model families it builds
    model_features: frozenset[str] = frozenset()   # ModelDims.features() it builds
    dtypes: frozenset[str] = frozenset({"bf16", "fp16", "fp32"})
    lora: bool = False                       # LoRA adapters
    lora_max_tp: int = 1                     # ... trained and read at tp at most this
    lora_zero: frozenset[int] = frozenset({0})     # ... trained at these ZeRO levels
    # the eval block generates with the trained replica of the evaluated model: trained at
    # these ZeRO levels and tp at most this
    eval_zero: frozenset[int] = frozenset({0})
    eval_max_tp: int = 1

    def engine(self, engine: Engine) -> EngineCapabilities | None:
        return next((e for e in self.engines if e.engine is engine), None)

    def with_engines(self, engines: tuple[EngineCapabilities, ...]) -> Capabilities:
        return attrs.evolve(self, engines=self.engines + engines)


def declared(backend: str):
    """The ``CAPABILITIES`` value a backend's data module declares."""
    module = importlib.import_module(f"backends.{backend}_backend.capabilities")
    return module.CAPABILITIES


def runtime_capabilities() -> Capabilities:
    """rpeg's runtime: the training backend's capabilities with every engine's."""
    train, *generators = RUNTIME_BACKENDS
    caps = declared(train)
    for name in generators:
        caps = caps.with_engines((declared(name),))
    return caps


__all__ = ["Capabilities", "EngineCapabilities", "RUNTIME_BACKENDS", "declared",
           "runtime_capabilities"]
