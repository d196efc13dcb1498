"""Which generation engine the planner may choose: vLLM only for models with head_dim >= 64."""

from __future__ import annotations

import attrs

from rpeg.cli import main
from rpeg.plan import SearchOptions, compile_plan
from rpeg.plan.space import generate_engines
from rpeg.spec import Engine, load

from .conftest import EVERY_ENGINE, ROOT

QUICK = SearchOptions(seed=3, iterations=200, patience=100, limits=EVERY_ENGINE)
LOCAL = str(ROOT / "pipelines/clusters/local_cpu.rpeg")


def _spec(tmp_path, preset: str = "tiny", engine: str | None = None):
    text = (ROOT / "pipelines/tiny_ppo.rpeg").read_text().replace(": tiny {", f": {preset} {{")
    if engine:
        text = text.replace("max_len = 20)", f"max_len = 20, engine = {engine})")
        assert f"engine = {engine}" in text
    (tmp_path / "rewards.py").write_text((ROOT / "pipelines/rewards.py").read_text())
    f = tmp_path / "v.rpeg"
    f.write_text(text)
    return f


def test_auto_leaves_out_vllm_for_narrow_heads(tmp_path, tiny, local_cpu):
    assert tiny.model("actor").dims.head_dim < 64
    assert generate_engines(tiny, "rollout", EVERY_ENGINE) == (Engine.TORCH,)
    plan = compile_plan(tiny, local_cpu, options=QUICK)
    assert plan.placement("rollout").engine is Engine.TORCH


def test_auto_may_choose_vllm_for_wide_heads(tmp_path):
    wide = load(_spec(tmp_path, "tiny-vllm"))
    assert wide.model("actor").dims.head_dim >= 64
    assert generate_engines(wide, "rollout", EVERY_ENGINE) == (Engine.VLLM, Engine.TORCH)
    torch_only = attrs.evolve(EVERY_ENGINE, engines=frozenset({Engine.TORCH}))
    assert generate_engines(wide, "rollout", torch_only) == (Engine.TORCH,)


def test_compile_refuses_explicit_vllm_on_narrow_heads(tmp_path, capsys):
    f = _spec(tmp_path, engine="vllm")
    rc = main(["compile", str(f), "--cluster", LOCAL,
               "-o", str(tmp_path / "p.json"), "--iterations", "50"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "vLLM needs head_dim >= 64; model 'actor' (tiny) has 16" in err, err
    assert "hint:" in err and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()
