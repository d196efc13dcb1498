"""Tensors are checked where they are read. A checkpoint whose manifest checks out (it was
rewritten after the damage) but whose tensors are truncated, of the wrong shape, NaN,
missing or extra, or whose meta.json is not an object, is refused by ``rpeg export`` and
``rpeg run --resume`` with exit 1, naming the checkpoint file and the tensor, and no
traceback; a resume goes on from an earlier checkpoint that is whole, and refuses when
none is. The damage goes where the run wrote the trained actor: a file of its sharded
checkpoint (``actor.dcp/``, read whole through DCP), or its whole ``model.safetensors``.
The check is one function over what the model's configuration implies and what was read
(``backends.torch_backend.modeling.check_tensors``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rpeg.errors import BackendError
from tests.reliability.test_run_dirs import _refused, _remanifest, _tree


def _trained(ck: Path) -> tuple[Path, Path]:
    """The checkpoint's trained actor: its replica folder (meta.json) and the file holding
    its weights, as the run wrote them: the shard file of its sharded checkpoint (meta.json
    names the folder of shards) that holds the first q_proj weight, or its
    ``model.safetensors`` where it was written whole."""
    for folder in sorted(ck.glob("actor@*")):
        meta = json.loads((folder / "meta.json").read_text())
        if "sharded" in meta:
            shards = sorted((ck / meta["sharded"]).glob("*.safetensors"))
            return folder, next(f for f in shards if _names(f, "q_proj.weight"))
        if (folder / "optimizer.safetensors").is_file():
            return folder, folder / "model.safetensors"
    raise AssertionError(f"{ck} holds no trained actor")


def _names(path: Path, ending: str) -> list[str]:
    with safe_open(str(path), framework="pt") as f:
        return sorted(k for k in f.keys() if k.endswith(ending))


def _edit(path: Path, edit) -> str:
    """Apply ``edit`` to the tensors of ``path``, keeping the file's own metadata (a shard's
    pieces' offsets); returns the tensor it names."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    name = _names(path, "q_proj.weight")[0]
    edit(tensors, name)
    save_file(tensors, str(path), metadata=metadata)
    return name


def _truncate(path: Path) -> str:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    return "readable in full"


DAMAGE = {
    "nan": (lambda t, n: t.__setitem__(n, t[n] * float("nan")), "must hold finite values"),
    "inf": (lambda t, n: t[n].__setitem__((0, 0), float("inf")), "1 of its"),
    "wrong-shape": (lambda t, n: t.__setitem__(n, t[n][:, :-1].contiguous()),
                    "must have the shape"),
    "missing": (lambda t, n: t.pop(n), "which the model's configuration has"),
    "extra": (lambda t, n: t.__setitem__("backbone.extra.weight", torch.zeros(2)),
              "only the model's tensors"),
    "wrong-dtype": (lambda t, n: t.__setitem__(n, t[n].double()), "must be torch.float32"),
}


def _damage(ck: Path, case: str) -> tuple[Path, str]:
    """Damage the trained actor's weights in checkpoint ``ck`` as ``case`` says, and
    rewrite its manifest to match: (the file, the words its refusal says)."""
    replica, path = _trained(ck)
    if case == "truncated":
        says = _truncate(path)
    elif case == "meta-list":
        (replica / "meta.json").write_text("[1, 2, 3]")
        path, says = replica / "meta.json", "must be a JSON object"
    elif case == "meta-version":
        (replica / "meta.json").write_text('{"version": "four"}')
        path, says = replica / "meta.json", "'version' must be a count"
    else:
        edit, says = DAMAGE[case]
        _edit(path, edit)
        if case == "missing" and path.parent != replica:
            path = path.parent             # in none of the shards: the folder of them lacks it
    _remanifest(ck)
    return path, says


CASES = sorted(DAMAGE) + ["truncated", "meta-list", "meta-version"]


@pytest.mark.parametrize("case", CASES)
def test_export_refuses_a_damaged_tensor_naming_it(run, tmp_path, capsys, case):
    path, says = _damage(run / "checkpoints" / "step-000004", case)
    out = tmp_path / "hf"
    _refused(["export", str(run), "-o", str(out)], capsys, str(path), says)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


@pytest.mark.parametrize("case", CASES)
def test_resume_refuses_when_every_checkpoint_is_damaged(run, capsys, case):
    for step in ("step-000002", "step-000004"):
        path, says = _damage(run / "checkpoints" / step, case)
    before = _tree(run)
    text = _refused(["run", "--resume", str(run), "--no-progress"], capsys,
                    "must hold a complete checkpoint", "skipping a damaged checkpoint", says,
                    "rpeg run")
    assert "--run-dir" in text                      # how to start a new run instead
    assert _tree(run) == before


def test_resume_refuses_a_run_without_checkpoints_rather_than_start_over(run, capsys):
    import shutil
    for ck in (run / "checkpoints").iterdir():
        shutil.rmtree(ck)
    before = _tree(run)
    _refused(["run", "--resume", str(run), "--no-progress"], capsys, "it holds none",
             "--run-dir")
    assert _tree(run) == before


def test_the_check_is_one_function_of_the_config_and_the_tensors(tmp_path):
    from backends.torch_backend.modeling import (
        build_model,
        check_tensors,
        checkpoint_tensors,
        expected_tensors,
    )
    from rpeg.spec.presets import PRESETS
    model = build_model(PRESETS["tiny"], ("lm", "value"))
    expected = expected_tensors(PRESETS["tiny"], {"lm", "value"})
    assert expected == checkpoint_tensors(model)            # from the config alone (meta)
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    check_tensors(expected, state, tmp_path / "x.safetensors")
    state["value_head.weight"] = torch.zeros(1, 3)
    with pytest.raises(BackendError, match=r"'value_head.weight' must have the shape \[1, 64\]"):
        check_tensors(expected, state, tmp_path / "x.safetensors")
