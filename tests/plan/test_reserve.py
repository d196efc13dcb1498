"""Memory a user can trust and shape: a reserve per device (the profile's or cluster's
``reserve``, or ``--memory-reserve``), kept free by every plan; the peak by kind and the
per-op FLOPs, bytes, MFU and MBU in every plan's output."""

from __future__ import annotations

import json

import pytest

from rpeg.cli import main
from rpeg.cost.memory import usable_memory, with_reserve
from rpeg.errors import CostError, SpecError
from rpeg.spec import load_cluster
from tests.conftest import ROOT

GRPO = str(ROOT / "pipelines" / "grpo_qwen7b.rpeg")
A100 = str(ROOT / "pipelines" / "clusters" / "a100_16.rpeg")
QUICK = ["--strategy", "colocated", "--no-gantt"]
LINK = "    link gpu { bandwidth = 450 GB/s; latency = 1 us }\n"


def cluster_file(tmp_path, body: str):
    p = tmp_path / "c.rpeg"
    p.write_text(f"cluster c {{\n{body}    gpus_per_node = 8\n{LINK}}}\n", encoding="utf-8")
    return p


def test_the_default_reserve_is_a_tenth(tmp_path):
    c = load_cluster(cluster_file(tmp_path, "    gpu = h100\n"))
    assert c.gpu.reserve == pytest.approx(0.1)
    assert usable_memory(c.gpu) == pytest.approx(72e9)


def test_a_cluster_sets_its_reserve_and_changes_a_shipped_profile(tmp_path):
    c = load_cluster(cluster_file(tmp_path, "    gpu h100 { memory = 72 GB }\n"
                                            "    reserve = 20%\n"))
    assert c.gpu.memory == 72e9 and c.gpu.reserve == pytest.approx(0.2)
    assert c.gpu.matmul_flops == 794.5e12            # the rest of the shipped h100 profile
    assert with_reserve(c, 0.05).gpu.reserve == 0.05
    with pytest.raises(CostError):
        with_reserve(c, 1.0)


@pytest.mark.parametrize("value", ["100%", "-5%", "1.5", "ten"])
def test_a_reserve_that_is_no_share_is_refused_where_written(tmp_path, value):
    with pytest.raises(SpecError) as e:
        load_cluster(cluster_file(tmp_path, f"    gpu = h100\n    reserve = {value}\n"))
    assert e.value.span.line == 3


def test_compile_keeps_the_reserve_and_prints_what_fills_each_gpu(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["compile", GRPO, "--cluster", A100, "-o", str(out), *QUICK,
                 "--memory-reserve", "25%"]) == 0
    text = capsys.readouterr().out
    for words in ("MFU", "MBU", "FLOP", "bytes moved", "weights", "optimizer", "KV cache",
                  "less a 25% reserve", "usable 60.0 GB"):
        assert words in text, words
    assert main(["compile", GRPO, "--cluster", A100, "-o", str(out), *QUICK, "--json",
                 "--memory-reserve", "0.25"]) == 0
    pr = json.loads(capsys.readouterr().out)["predicted"]
    assert pr["memory_reserve"] == pytest.approx(20e9)
    assert max(pr["peak_memory"]) <= 60e9
    assert {"stage", "flops", "bytes", "time_s", "mfu", "mbu"} <= set(pr["ops"][0])
    assert sorted(d for m in pr["memory"] for d in m["devices"]) == list(range(16))
    # the plan file reads back with them, and compiles again under the same reserve
    assert main(["compile", str(out), "--no-gantt"]) == 0
    assert "the same plan" in capsys.readouterr().out


def test_a_reserve_that_is_no_share_is_a_usage_error(tmp_path):
    assert main(["compile", GRPO, "--cluster", A100, "-o", str(tmp_path / "p.json"),
                 *QUICK, "--memory-reserve", "120%"]) == 2
