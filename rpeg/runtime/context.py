"""What every worker is told once, at set-up: the run's spec, plan, and its own place in it.

    >>> ctx = RunContext.create(pipeline, plan, spec_dir="pipelines", run_dir="runs/x")  # doctest: +SKIP
    >>> ctx.replicas_on(0)                                                             # doctest: +SKIP
    (Replica(model='actor', device=0, heads=('lm',), trainable=True), ...)

Model state is created on a worker once, from this, and lives there for the
whole run; op calls then carry only their own small description and the
futures of their data.
"""

from __future__ import annotations

import attrs
import numpy as np

from rpeg.plan.model import Plan
from rpeg.runtime.data import Cursor
from rpeg.runtime.instances import OpCall, base_of, model_homes, replica_layouts
from rpeg.spec.model import Head, Pipeline


@attrs.frozen
class Replica:
    """One copy of a backbone's state on one device."""

    model: str                       # backbone key ("actor", or "actor+critic" when shared)
    device: int
    heads: tuple[str, ...]           # "lm", "value"
    trainable: bool                  # holds an optimizer (a home device of a trained model)
    world: tuple[int, ...] = ()      # devices training it (dp x tp; len > 1: collectives)
    tp: tuple[int, ...] = ()         # its tensor-parallel group (len > 1: weights sharded)


@attrs.frozen
class RunContext:
    pipeline: Pipeline
    plan: Plan
    spec_dir: str
    run_dir: str
    backend: str = "torch"
    replicas: tuple[Replica, ...] = ()
    num_devices: int = 1
    dist_addr: str = ""              # tcp://host:port of the collective rendezvous ("" = none)
    use_cuda: bool = False
    threads: int = 1                 # intra-op threads per worker
    data: Cursor = Cursor()          # where the run reads its prompts from (a resume's)

    @classmethod
    def create(cls, pipeline: Pipeline, plan: Plan, calls: tuple[OpCall, ...], *, spec_dir: str,
               run_dir: str, dist_addr: str = "", use_cuda: bool = False) -> RunContext:
        homes = model_homes(pipeline, plan, _graph(pipeline, plan))
        wanted: dict[tuple[str, int], set[str]] = {}
        for c in calls:
            if c.model is None:
                continue
            heads = wanted.setdefault((c.model, c.device), set())
            heads.update(_heads(pipeline, c.model))
        groups = replica_layouts(calls)
        replicas = tuple(
            Replica(model, dev, tuple(sorted(heads)),
                    trainable=dev in homes.get(model, ()),
                    world=homes.get(model, ()) if dev in homes.get(model, ()) else (),
                    tp=groups.get((model, dev), ()))
            for (model, dev), heads in sorted(wanted.items()))
        return cls(pipeline, plan, spec_dir, run_dir, replicas=replicas,
                   num_devices=plan.num_devices, dist_addr=dist_addr, use_cuda=use_cuda)

    def replicas_on(self, device: int) -> tuple[Replica, ...]:
        return tuple(r for r in self.replicas if r.device == device)

    @property
    def needs_collectives(self) -> bool:
        return any(len(r.world) > 1 or len(r.tp) > 1 for r in self.replicas)


def _graph(pipeline, plan):
    from rpeg.runtime.instances import graph_for
    return graph_for(pipeline, plan)


def _heads(pipeline: Pipeline, backbone: str) -> set[str]:
    heads = set()
    for name in base_of(backbone).split("+"):
        m = pipeline.model(name)
        heads.add("lm" if m.head is Head.LM else "value")
    return heads


# --- workload data (rpeg.runtime.data reads the rows) ---------------------------------------
def group_of(prompt_index: np.ndarray, samples: int) -> np.ndarray:
    """The prompt (group) each response belongs to."""
    return np.asarray(prompt_index) // max(samples, 1)

