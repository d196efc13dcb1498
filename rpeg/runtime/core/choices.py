"""The run's choices outside a segment: which workers a start takes, which saved replica each
model restores from, whether a resume restarts at its cut, where the eval runs, which
replicas a cut saves and which checkpoints it keeps. Pure functions of what the adapter found; no Dask, no files.

    >>> take_workers(["tcp://a", "tcp://b", "tcp://c"], lost={"tcp://a"}, n=2)
    {0: 'tcp://b', 1: 'tcp://c'}
    >>> pruned([2, 4, 6, 8], keep=2)
    [2, 4]
    >>> best_source({"actor@0": 4, "actor@1": 4, "critic@1": 3}, "actor", trained={"actor@1"})
    'actor@1'

The Dask adapter (``rpeg.runtime.dask``) asks the cluster and reads the checkpoint, then
carries out what these return; the scheduling core's own decisions (what to submit, when a
segment ends, what is stuck) are in ``rpeg.runtime.core.scheduler``.
"""

from __future__ import annotations

from rpeg.graph.ids import ReplicaAt, ReplicaKey


def take_workers(alive, lost, n: int) -> dict[int, str] | None:
    """Device -> worker for a start needing ``n`` devices: the first ``n`` workers there (in
    the order given: sorted addresses) that were never lost (a worker blamed for a loss may
    be frozen, not gone); None when fewer are there."""
    have = [a for a in alive if a not in lost]
    return dict(enumerate(have[:n])) if len(have) >= n else None


def workers_wait_s(attempt: int, replace_wait_s: float) -> float:
    """How long a start waits for enough workers: the cluster's own at the first attempt,
    a replacement for a lost one after it (the nanny restarts it; a spare may join)."""
    return replace_wait_s if attempt > 1 else FIRST_WORKERS_S


FIRST_WORKERS_S = 30.0


def pruned(steps, keep: int) -> list[int]:
    """The complete checkpoints (by step) a cut removes: all but the newest ``keep``
    (``keep`` = 0: all of them)."""
    done = sorted(steps)
    return done[:-keep] if keep else done


def rebuildable(versions: dict[str, tuple[int, bool, bool, bool]]) -> set[str]:
    """Replicas a cut does not save, as a resume rebuilds them without their files: a frozen model (made again from its
    weights or seed), and a copy whose version equals its trained replica's (loaded from
    that one's files) and that keeps no partial rollouts (only its own files hold them)."""
    trained = {ReplicaAt(k).key: v for k, (v, home, _, _) in versions.items() if home}
    return {k for k, (v, home, frozen, carries) in versions.items()
            if frozen or (not home and not carries and trained.get(ReplicaAt(k).key) == v)}


def best_source(saved: dict[str, int], model: str, trained) -> str:
    """The saved replica (``model@device`` -> version) a copy of ``model`` restores from on
    a device where it was not saved: its newest replica, of the same copy or, when the
    backbone it copies has a newer one, of the backbone; one with optimizer state
    (``trained``: the replicas saved with it) before one without.

        >>> best_source({"actor~vllm@0": 3, "actor@1": 4}, "actor~vllm", trained={"actor@1"})
        'actor@1'
    """
    key = ReplicaKey(model)
    cands = [k for k in saved if ReplicaAt(k).key == key]
    newest = max((saved[k] for k in saved if ReplicaAt(k).key.backbone == key.backbone),
                 default=None)
    if not cands or (newest is not None and max(saved[k] for k in cands) < newest):
        cands = [k for k in saved if ReplicaAt(k).key.backbone == key.backbone]
    with_opt = [k for k in cands if k in trained]
    return max(with_opt or cands, key=lambda k: saved[k])


def restore_sources(saved: dict[str, int], device: int, trained, *, restart: bool
                    ) -> dict[str, str]:
    """Copy -> the saved replica a worker of ``device`` restores it from: its own where it
    was saved on this device, else :func:`best_source` (a plan re-made for fewer devices
    maps state by model); ``restart`` (an extended run restarts at its cut, every replica at
    the newest version, as at step 0): always the best source.

        >>> restore_sources({"actor@0": 2, "actor@1": 2}, 1, set(), restart=False)
        {'actor': 'actor@1'}
    """
    out: dict[str, str] = {}
    for k in saved:
        if ReplicaAt(k).device == device:
            out[ReplicaAt(k).key] = k
    for k in saved:
        model = ReplicaAt(k).key
        if restart:
            out[model] = best_source(saved, model, trained)
        out.setdefault(model, best_source(saved, model, trained))
    return out


def restarts_at_cut(cut: int, reach: int, made_for: int, steps: int) -> bool:
    """Whether a resume to ``steps`` (the run was made for ``made_for``) from the checkpoint
    at ``cut`` restarts there, every replica at the checkpoint's version: the cut was made
    for a run that ended within ``2 * reach`` steps of it (``reach``: how far back any
    dependency reaches), so what it carries is not what the longer run reads.

        >>> restarts_at_cut(59, 1, 60, 120), restarts_at_cut(40, 1, 60, 120)
        (True, False)
    """
    return steps != made_for and cut + 2 * reach > min(made_for, steps)


def eval_home(homes: dict[str, list[int]], generates) -> tuple[str, int] | None:
    """(replica, device) the eval block runs on: the first trained replica (``homes``:
    replica -> its devices, in the plan's order) whose backbone holds the generating model
    (``generates(replica)``), on its first device; None when the plan trains none.

        >>> eval_home({"critic": [1], "actor": [0, 1]}, lambda m: m == "actor")
        ('actor', 0)
    """
    for model, devices in homes.items():
        if generates(model) and devices:
            return model, devices[0]
    return None
