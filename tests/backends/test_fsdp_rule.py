"""Whether FSDP2 runs a trained copy: one predicate both sides call
(``rpeg.cost.memory.fsdp_runs``): the runtime lays the copy out by it
(``backends.torch_backend.sharding.TrainLayout.fsdp``) and the cost model prices the
float32 shards FSDP2 keeps beside a ZeRO-2 copy's whole weights by it (``grad_bytes``)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from backends.torch_backend import sharding  # noqa: E402
from backends.torch_backend.sharding import TrainLayout  # noqa: E402
from rpeg.cost import memory  # noqa: E402
from rpeg.cost.memory import grad_bytes  # noqa: E402
from rpeg.cost.profiles import builtin_cluster  # noqa: E402
from rpeg.graph.layout import Layout
from rpeg.spec.model import Model, Optimizer, Zero  # noqa: E402
from rpeg.spec.presets import PRESETS  # noqa: E402


def test_both_sides_hold_the_one_predicate():
    assert sharding.fsdp_runs is memory.fsdp_runs


def _model() -> Model:
    return Model("actor", "tiny", PRESETS["tiny"], optimizer=Optimizer("adam", lr=1e-3))


@pytest.mark.parametrize("dp,tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_the_layout_runs_fsdp_where_the_shards_are_priced(dp, tp):
    """A ZeRO-2 copy on a float32 GPU profile: FSDP2's float32 shards are priced exactly
    where the runtime lays the copy out with FSDP2."""
    gpu = builtin_cluster("local_cpu").gpu
    layout = TrainLayout.of(tuple(range(dp * tp)), tuple(range(tp)) if tp > 1 else (),
                            zero=Zero.GRADIENTS)
    extra, _ = grad_bytes(_model(), Layout(dp=dp, tp=tp, zero=Zero.GRADIENTS), gpu)
    assert layout.fsdp == (extra > 0)


def test_one_edit_of_the_predicate_changes_both_sides(monkeypatch):
    """FSDP2 never, edited in the one predicate: the runtime lays a ZeRO-2 copy out without
    it, and the cost model prices no float32 shards for it."""
    gpu = builtin_cluster("local_cpu").gpu
    par = Layout(dp=2, zero=Zero.GRADIENTS)
    layout = TrainLayout.of((0, 1), zero=Zero.GRADIENTS)
    assert layout.fsdp and grad_bytes(_model(), par, gpu)[0] > 0
    for side in (sharding, memory):
        monkeypatch.setattr(side, "fsdp_runs", lambda zero, shards, tp: False)
    assert not layout.fsdp and grad_bytes(_model(), par, gpu)[0] == 0
