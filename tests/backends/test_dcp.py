"""Sharded checkpoints (``backends.torch_backend.dcp``, torch.distributed.checkpoint) on two
real gloo ranks: a ZeRO-3 trainer at dp 2 writes each rank's shard once, about the bytes
of the same trainer's checkpoint at dp 1 (before, every rank wrote the whole model and Adam
state: 2x and more); read back whole in one process it is exactly what the ranks hold; it
loads exactly into a replica laid out otherwise (ZeRO-2 at dp 2, a plain model at dp 1:
resharded on the way in); and no file of it needs unpickling (safetensors only)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.backends.ranks import answers

STEPS = 2


def _trained(zero: int, world: tuple[int, ...], rank: int, seed: int = 0):
    import torch

    from backends.torch_backend.modeling import build_model
    from backends.torch_backend.sharding import Trained, TrainLayout
    from backends.torch_backend.train import TokenHeads
    from rpeg.spec.model import Model, Optimizer
    from rpeg.spec.presets import PRESETS
    dims = PRESETS["tiny"]
    members = [Model("actor", "tiny", dims, optimizer=Optimizer("adam", lr=1e-3))]
    model = build_model(dims, heads=("lm",), seed=seed)
    return Trained.build(model, TokenHeads(model), members, TrainLayout.of(world, zero=zero),
                         device="cpu", dtype=torch.float32, master=True, device_index=rank)


def _rank(rank: int, port: int, q, folder: str) -> None:
    import torch

    from backends.torch_backend import distributed as D
    from backends.torch_backend.dcp import load_sharded, save_sharded
    from backends.torch_backend.state import gathered
    from backends.torch_backend.train import LossSpec, train_step
    from tests.backends.test_sharding import _batch

    torch.set_num_threads(1)
    D.init_world(rank, 2, f"tcp://127.0.0.1:{port}", [(0, 1), (0,), (1,)])
    trained = _trained(3, (0, 1), rank)
    for step in range(STEPS):
        trained.before_step()
        train_step(trained.heads, trained.optimizer, _batch(), [LossSpec("ppo_clip", clip=0.2)],
                   version=0, minibatches=1, microbatches=1, seed=step, grad_clip=1.0,
                   rank=rank, world=2)
        trained.after_step()
    save_sharded(trained, (0, 1), Path(folder) / "zero3-dp2")
    held = gathered(trained)
    other = _trained(2, (0, 1), rank, seed=9)        # another layout, other weights
    load_sharded(other, (0, 1), Path(folder) / "zero3-dp2")
    again = gathered(other)
    if rank == 0:
        q.put(({k: v.numpy() for k, v in held.items()},
               max(float((again[k] - held[k]).abs().max()) for k in held)))
    D.shutdown_world()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dcp")
    (held, zero2_diff), = answers(_rank, 2, str(folder), count=1)
    return folder, held, zero2_diff


def test_each_rank_writes_its_shard_once_about_the_dp1_size(saved, recwarn):
    import torch

    from backends.torch_backend.dcp import files, save_sharded
    folder, held, _ = saved
    shards = files(folder / "zero3-dp2")
    assert len(shards) == 2
    one = _trained(0, (0,), 0)                       # dp 1: a world of one, no collective
    with torch.no_grad():
        for name, p in one.model.named_parameters():
            p.copy_(torch.as_tensor(held[name]))
    save_sharded(one, (0,), folder / "dp1")
    # one process by design: DCP's warning that it assumes so is not passed on to the run
    assert not [w for w in recwarn if "torch.distributed is disabled" in str(w.message)]
    dp2 = sum(p.stat().st_size for p in shards)
    dp1 = sum(p.stat().st_size for p in files(folder / "dp1"))
    assert dp2 <= 1.3 * dp1, (dp2, dp1)


def test_read_whole_is_what_the_ranks_hold(saved):
    from backends.torch_backend.dcp import read_whole
    folder, held, _ = saved
    whole = read_whole(folder / "zero3-dp2")
    assert set(whole) == set(held)
    assert max(float(np.abs(whole[k].numpy() - held[k]).max()) for k in held) == 0.0


def test_it_loads_exactly_on_another_layout(saved):
    from backends.torch_backend.dcp import flat_state, load_sharded
    folder, held, zero2_diff = saved
    assert zero2_diff == 0.0                          # ZeRO-2 at dp 2, resharded
    one = _trained(0, (0,), 0, seed=7)                # a plain model at dp 1
    load_sharded(one, (0,), folder / "zero3-dp2")
    state = flat_state(one)
    assert max(float(np.abs(state[k].detach().numpy() - held[k]).max()) for k in held) == 0.0


def test_no_file_of_it_is_a_pickle(saved):
    folder, _, _ = saved
    for p in (folder / "zero3-dp2").iterdir():
        assert p.suffix in (".safetensors", ".json"), p.name


def _damaged(saved, tmp_path, edit, rank: int) -> Path:
    """A copy of the dp 2 checkpoint with ``edit(tensors)`` applied to the tensors of rank
    ``rank``'s file (its pieces' offsets kept); returns that file."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from backends.torch_backend.dcp import files
    folder = tmp_path / "ck"
    shutil.copytree(saved[0] / "zero3-dp2", folder)
    path = files(folder)[rank]
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata=metadata)
    return path


Q = "backbone.layers.0.self_attn.q_proj.weight"


def test_a_sharded_replica_is_checked_and_read_whole(saved, tmp_path):
    import json
    import shutil

    from backends.torch_backend.modeling import expected_tensors, read_replica
    from rpeg.spec.presets import PRESETS
    folder, held, _ = saved
    shutil.copytree(folder / "zero3-dp2", tmp_path / "actor.dcp")
    (tmp_path / "actor@0").mkdir()
    (tmp_path / "actor@0" / "meta.json").write_text(json.dumps({"version": 2,
                                                                "sharded": "actor.dcp"}))
    meta, weights = read_replica(tmp_path / "actor@0", expected_tensors(PRESETS["tiny"], {"lm"}))
    assert meta["version"] == 2
    assert set(weights) == {k for k in held if "::" not in k}
    assert max(float(np.abs(weights[k].numpy() - held[k]).max()) for k in weights) == 0.0


@pytest.mark.parametrize("case, rank, says", [
    ("nan", 1, "must hold finite values, and 2,048 of the 2,048 of its 4,096 this file holds"),
    ("moment", 1, "must hold finite values"), ("tail", 1, "must have the shape [64, 64]"),
    ("gap", 0, "2,048 of its 4,096 values are in none")])
def test_a_damaged_shard_is_refused_naming_its_file(saved, tmp_path, case, rank, says):
    """A piece of one rank's file damaged: NaN in a weight or in a moment, or a piece
    left out (the other rank's pieces alone do not make the tensor whole: short at its
    end, or with a gap before)."""
    from backends.torch_backend.modeling import check_shards, expected_tensors
    from rpeg.errors import BackendError
    from rpeg.spec.presets import PRESETS

    def edit(t):
        if case in ("gap", "tail"):
            t.pop(Q)
        else:
            key = Q if case == "nan" else f"{Q}::exp_avg"
            t[key] = t[key] * float("nan")
    path = _damaged(saved, tmp_path, edit, rank)
    with pytest.raises(BackendError) as e:
        check_shards(path.parent, expected_tensors(PRESETS["tiny"], {"lm"}))
    assert says in str(e.value) and Q in str(e.value)
    # the file at fault; a piece in no file: the file that holds the rest of it
    other = sorted(p for p in path.parent.glob("*.safetensors") if p != path)[0]
    assert str(path if case in ("nan", "moment") else other) in str(e.value)


@pytest.mark.parametrize("world, tp, zero", [((1, 2), (), 3), ((1, 2, 3, 4), (1, 2), 3),
                                             ((1, 2, 3, 4), (1, 2), 0), ((0, 1), (0, 1), 0)])
def test_every_rank_of_a_trained_replica_meets_in_one_group_to_checkpoint(world, tp, zero):
    """DCP saves and loads over the replica's whole world: a run creates that group on every
    rank, whatever the mesh (a dp 2 x tp 2 trainer had only its dp and tp groups, and its
    first checkpoint failed)."""
    from backends.torch_backend.sharding import TrainLayout, mesh_groups
    from rpeg.graph.layout import Layout
    from rpeg.runtime.lowering.context import Replica
    replica = Replica("actor", world[0], ("lm",), trainable=True, world=world, tp=tp,
                      layout=Layout(zero=zero))
    assert world in replica.layout_groups
    assert set(replica.layout_groups) == set(mesh_groups(TrainLayout.of(world, tp, zero=zero)))


def test_tied_embeddings_are_held_once_and_read_back_whole(tmp_path):
    """A model whose output layer shares the embedding (SmolLM2's tie_word_embeddings): the
    sharded checkpoint holds the shared tensor once, under the embedding's name, and it
    is checked and read back whole as the configuration says (the tied name not missing)."""
    import json

    import attrs
    import torch
    from safetensors import safe_open

    from backends.torch_backend.dcp import files, save_sharded
    from backends.torch_backend.modeling import build_model, expected_tensors, read_replica
    from backends.torch_backend.sharding import Trained, TrainLayout
    from backends.torch_backend.train import TokenHeads
    from rpeg.spec.model import Model, Optimizer
    from rpeg.spec.presets import PRESETS

    dims = attrs.evolve(PRESETS["tiny"], tied_embeddings=True)
    model = build_model(dims, heads=("lm",), seed=0)
    members = [Model("actor", "tiny", dims, optimizer=Optimizer("adam", lr=1e-3))]
    trained = Trained.build(model, TokenHeads(model), members, TrainLayout.of((0,), zero=0),
                            device="cpu", dtype=torch.float32, master=True, device_index=0)
    save_sharded(trained, (0,), tmp_path / "actor.dcp")
    names = set()
    for f in files(tmp_path / "actor.dcp"):
        with safe_open(str(f), framework="pt") as st:
            names |= {k for k in st.keys() if "::" not in k}
    expected = expected_tensors(dims, {"lm"})
    assert expected.tied and not expected.tied & names           # held once
    assert names == set(expected) - expected.tied
    (tmp_path / "actor@0").mkdir()
    (tmp_path / "actor@0" / "meta.json").write_text(json.dumps({"version": 1,
                                                                "sharded": "actor.dcp"}))
    _, weights = read_replica(tmp_path / "actor@0", expected)
    state = model.state_dict()
    assert max(float((weights[k] - state[k]).abs().max()) for k in weights) == 0.0
