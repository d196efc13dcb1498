"""Optimizers from the spec (adam, adamw) and their learning-rate schedule.

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
    first = members[0].optimizer
    groups = [{"params": [p for n, p in model.named_parameters()
                          if not n.startswith("value_head")], "base_lr": first.lr}]
    value_opt = next((m.optimizer for m in members if m.head is not Head.LM), first)
    value_params = [p for n, p in model.named_parameters() if n.startswith("value_head")]
    if value_params:
        groups.append({"params": value_params, "base_lr": value_opt.lr})
    for g in groups:
        g["lr"] = g["base_lr"]
    return groups


@implements("adam")
def adam(model, members) -> torch.optim.Optimizer:
    first = members[0].optimizer
    return torch.optim.Adam(_groups(model, members), betas=tuple(first.betas), eps=first.eps,
                            weight_decay=first.weight_decay)


@implements("adamw")
def adamw(model, members) -> torch.optim.Optimizer:
    first = members[0].optimizer
    return torch.optim.AdamW(_groups(model, members), betas=tuple(first.betas), eps=first.eps,
                             weight_decay=first.weight_decay)


def build_optimizer(model, members):
    """(optimizer, the spec it follows) for a replica of ``members`` (one model, or a shared
    backbone's): the first trainable member's kind and settings; a value head's rate from
    the member that has it."""
    from backends.torch_backend.algorithms import implementation
    trainable = [m for m in members if m.optimizer is not None]
    if not trainable:
        raise BackendError(f"model '{members[0].name}' is trained, so it must have an optimizer",
                           members[0].span, hint="add { optimizer = adam(lr = 1e-5) }")
    spec = trainable[0].optimizer
    return implementation(spec.kind)(model, trainable), spec
