"""The checkpoint a vLLM engine starts from is written on any rank: transformers'
``save_pretrained`` writes a model's files on rank 0 of a ``torch.distributed`` world only,
so an engine copy hosted beside rank 1 (an engine on a ZeRO-3 trainer's second device)
found an empty folder and the run failed at set-up. ``save_policy`` writes the files itself;
two gloo ranks each write theirs, and vLLM's loader reads the same names."""

from __future__ import annotations

import json
from pathlib import Path

from tests.backends.ranks import answers


def _rank(rank: int, port: int, q, folder: str) -> None:
    import torch

    from backends.torch_backend import distributed as D
    from backends.torch_backend.modeling import build_model
    from backends.vllm_backend.models import save_policy
    from rpeg.spec.presets import PRESETS

    torch.set_num_threads(1)
    D.init_world(rank, 2, f"tcp://127.0.0.1:{port}", [(0, 1)])
    path = save_policy(build_model(PRESETS["tiny-vllm"], heads=("lm", "value"), seed=0),
                       Path(folder) / f"policy{rank}")
    q.put((rank, sorted(p.name for p in path.iterdir())))
    D.shutdown_world()


def test_every_rank_writes_the_policy_an_engine_starts_from(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    got = dict(answers(_rank, 2, str(tmp_path)))
    assert got[0] == got[1] and {"config.json", "model.safetensors"} <= set(got[1])
    config = json.loads((tmp_path / "policy1" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "policy1")   # loads as written
    with safe_open(str(tmp_path / "policy1" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(model.state_dict())
