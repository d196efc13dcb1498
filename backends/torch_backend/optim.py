"""Optimizers from the spec (adam, adamw), over float32 masters of 16-bit parameters
(:class:`MasterAdam`), and their learning-rate schedule.

    >>> from rpeg.spec.model import Optimizer
    >>> o = Optimizer("adamw", lr=1e-3, schedule="cosine", warmup=2, min_lr=1e-4)
    >>> [round(lr_at(o, 1e-3, step, steps=10), 6) for step in (0, 1, 2, 9)]
    [0.0005, 0.001, 0.001, 0.0001]

The schedule is a function of the train op's step (the replica's version: how
many updates its weights have seen) and the run's steps, so a resumed or
recovered run sets the same rate at the same step. Warmup rises linearly over
``warmup`` steps (the first step at lr / warmup); then ``constant`` stays at lr,
``linear`` and ``cosine`` fall from lr after warmup to ``min_lr`` at the last step.
"""

from __future__ import annotations

import math

import torch

from backends.torch_backend.algorithms import implements
from rpeg.errors import BackendError
from rpeg.spec.model import Head

SCHEDULES = ("constant", "linear", "cosine")


def lr_at(opt, base: float, step: int, steps: int) -> float:
    """The learning rate of a parameter group with peak ``base`` at train step ``step``."""
    if opt.warmup and step < opt.warmup:
        return base * (step + 1) / opt.warmup
    if opt.schedule == "constant":
        return base
    span = max(steps - 1 - opt.warmup, 1)
    done = min(max(step - opt.warmup, 0) / span, 1.0)
    low = min(opt.min_lr, base)
    if opt.schedule == "linear":
        return base + (low - base) * done
    return low + 0.5 * (base - low) * (1.0 + math.cos(math.pi * done))


def set_lr(optimizer: torch.optim.Optimizer, spec, step: int, steps: int) -> float:
    """Set every parameter group's rate for ``step``; returns the first group's."""
    for group in optimizer.param_groups:
        group["lr"] = lr_at(spec, group["base_lr"], step, steps)
    return float(optimizer.param_groups[0]["lr"])


def _groups(model, members):
    """The backbone and LM head at the first member's rate, the value head at the value
    model's; parameters that do not train (a LoRA model's backbone) are left out."""
    first = members[0].optimizer
    groups = [{"params": [p for n, p in model.named_parameters()
                          if not n.startswith("value_head") and p.requires_grad],
               "base_lr": first.lr}]
    value_opt = next((m.optimizer for m in members if m.head is not Head.LM), first)
    value_params = [p for n, p in model.named_parameters() if n.startswith("value_head")]
    if value_params:
        groups.append({"params": value_params, "base_lr": value_opt.lr})
    for g in groups:
        g["lr"] = g["base_lr"]
    return groups


def _adam(cls, model, members, master: bool) -> torch.optim.Optimizer:
    first = members[0].optimizer
    kwargs = dict(betas=tuple(first.betas), eps=first.eps, weight_decay=first.weight_decay)
    if master:                        # float32 copies of 16-bit parameters
        return MasterAdam(_groups(model, members), cls, **kwargs)
    return cls(_groups(model, members), **kwargs)


class MasterAdam(torch.optim.Optimizer):
    """Adam(W) that updates float32 copies of 16-bit parameters and writes them back.

    The copies live in this optimizer's state (``master``), beside the two moments: the
    12 bytes per parameter the cost model prices as optimizer state."""

    def __init__(self, groups, cls, **kwargs) -> None:
        self.inner_cls = cls
        masters = [{**g, "params": [p.detach().clone().float() for p in g["params"]]}
                   for g in groups]
        self.inner = cls(masters, **kwargs)
        super().__init__(groups, dict(kwargs, lr=groups[0]["lr"]))
        for g, m in zip(self.param_groups, self.inner.param_groups, strict=True):
            for p, q in zip(g["params"], m["params"], strict=True):
                self.state[p]["master"] = q

    @torch.no_grad()
    def step(self, closure=None):
        for g, m in zip(self.param_groups, self.inner.param_groups, strict=True):
            m["lr"] = g["lr"]                     # a schedule sets the outer groups' rate
            for p, q in zip(g["params"], m["params"], strict=True):
                q.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for g, m in zip(self.param_groups, self.inner.param_groups, strict=True):
            for p, q in zip(g["params"], m["params"], strict=True):
                if q.grad is not None:
                    p.copy_(q)
                    q.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for st in self.inner.state.values() for t in st.values()
                if torch.is_tensor(t) and t.dim() > 0] + \
            [q for m in self.inner.param_groups for q in m["params"]]

    def moments(self, p) -> dict[str, torch.Tensor]:
        """The inner optimizer's state of parameter ``p`` (exp_avg, exp_avg_sq, step)."""
        return self.inner.state.get(self.state[p]["master"], {})


@implements("adam")
def adam(model, members, master: bool = False) -> torch.optim.Optimizer:
    return _adam(torch.optim.Adam, model, members, master)


@implements("adamw")
def adamw(model, members, master: bool = False) -> torch.optim.Optimizer:
    return _adam(torch.optim.AdamW, model, members, master)


def build_optimizer(model, members, master: bool = False):
    """(optimizer, the spec it follows) for a replica of ``members`` (one model, or a shared
    backbone's): the first trainable member's kind and settings; a value head's rate from
    the member that has it; over float32 master weights with ``master``."""
    from backends.torch_backend.algorithms import implementation
    trainable = [m for m in members if m.optimizer is not None]
    if not trainable:
        raise BackendError(f"model '{members[0].name}' is trained, so it must have an optimizer",
                           members[0].span, hint="add { optimizer = adam(lr = 1e-5) }")
    spec = trainable[0].optimizer
    return implementation(spec.kind)(model, trainable, master), spec
