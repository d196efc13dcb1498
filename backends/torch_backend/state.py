"""A trained replica's state made whole for a checkpoint: weights and Adam moments.

    >>> whole = gathered(replica.trained)        # every rank of the model at once  # doctest: +SKIP
    >>> sorted(whole)[:2]                                                           # doctest: +SKIP
    ['backbone.embed_tokens.weight', 'backbone.embed_tokens.weight::exp_avg']

For a model sharded by FSDP2 (and tensor parallelism with it) each tensor is gathered over
its mesh, a collective: the runtime checkpoints every worker at once, and each walks its
replicas in one order. The weights written are the float32 master weights where the
optimizer keeps them (``sharding.MasterAdam``), so a resumed run continues exactly.
"""

from __future__ import annotations

import torch

from backends.torch_backend.optim import MasterAdam
from backends.torch_backend.sharding import optimizer_state
from backends.torch_backend.weights import whole


def gathered(trained) -> dict[str, torch.Tensor]:
    """``name`` -> whole weight, ``name::exp_avg`` / ``name::exp_avg_sq`` -> whole moment,
    ``name::step`` -> the step count, as float32 CPU tensors."""
    with trained.state_on_device():
        return _gathered(trained)


def _gathered(trained) -> dict[str, torch.Tensor]:
    trained.unsettle()               # the sharded parameters, as the optimizer holds them
    try:
        opt = trained.optimizer
        params = list(trained.model.named_parameters())
        states = [optimizer_state(opt, p) for _, p in params]
        # Every rank gathers the same tensors in the same order: a rank whose shard of a
        # parameter is empty (FSDP2: fewer rows than ranks) may hold no state for it
        stepped = any(states)
        step = max((float(st["step"]) for st in states if "step" in st), default=0.0)
        out: dict[str, torch.Tensor] = {}
        for (name, p), st in zip(params, states, strict=True):
            master = opt.state[p].get("master") if isinstance(opt, MasterAdam) else None
            out[name] = _cpu(master if master is not None else p)
            if not stepped or not p.requires_grad:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{name}::{key}"] = _cpu(st[key] if key in st else torch.zeros_like(p))
            out[f"{name}::step"] = torch.tensor(float(st.get("step", step)))
        return out
    finally:
        trained.settle()


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return whole(t).detach().to("cpu", torch.float32).contiguous()


__all__ = ["gathered"]
