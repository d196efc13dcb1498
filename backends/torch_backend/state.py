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

from backends.torch_backend.sharding import MasterAdam, optimizer_state
from backends.torch_backend.weights import whole


def gathered(trained) -> dict[str, torch.Tensor]:
    """``name`` -> whole weight, ``name::exp_avg`` / ``name::exp_avg_sq`` -> whole moment,
    ``name::step`` -> the step count, as float32 CPU tensors."""
    trained.unsettle()               # the sharded parameters, as the optimizer holds them
    try:
        opt = trained.optimizer
        out: dict[str, torch.Tensor] = {}
        for name, p in trained.model.named_parameters():
            master = opt.state[p].get("master") if isinstance(opt, MasterAdam) else None
            out[name] = _cpu(master if master is not None else p)
            st = optimizer_state(opt, p)
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    out[f"{name}::{key}"] = _cpu(st[key])
            if "step" in st:
                out[f"{name}::step"] = torch.tensor(float(st["step"]))
        return out
    finally:
        trained.settle()


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return whole(t).detach().to("cpu", torch.float32).contiguous()


__all__ = ["gathered"]
