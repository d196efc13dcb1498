"""The one-line predicted cost of a change, and the pictures' building blocks."""

from __future__ import annotations

from rpeg.experiments import plots
from rpeg.experiments.explain import cost_sentence, memory_words

GB = 1e9


def test_sentence_names_the_devices_whose_memory_moved():
    a = {"step_time_s": 10.0, "peak_memory_per_device": [40 * GB] * 16 + [20 * GB] * 16}
    b = {"step_time_s": 8.8, "peak_memory_per_device": [43 * GB] * 16 + [20 * GB] * 16}
    assert cost_sentence(["staleness rollout 1 -> 2"], a, b) == \
        "staleness rollout 1 -> 2: predicted step time -12%, peak memory +3 GB on GPUs 0-15"


def test_sentence_counts_extra_changes_and_small_moves():
    a = {"step_time_s": 1.0, "peak_memory_per_device": [1 * GB, 1 * GB]}
    b = {"step_time_s": 1.004, "peak_memory_per_device": [1 * GB, 1 * GB]}
    s = cost_sentence(["x 1 -> 2", "y 2 -> 3", "z 3 -> 4"], a, b)
    assert s == "x 1 -> 2, y 2 -> 3 and 1 more change: predicted step time unchanged, " \
                "peak memory unchanged"
    assert cost_sentence(["x"], {"error": "no plan fits"}, b) is None


def test_memory_moved_placement_compares_largest_peaks():
    words = memory_words([80 * GB, 10 * GB], [10 * GB, 84 * GB], same_layout=False)
    assert words == "+4 GB per GPU at most (80 GB -> 84 GB)"
    assert memory_words([1 * GB], [1.5 * GB]) == "+500 MB on GPU 0"


def test_merge_rows_groups_devices_that_ran_the_same_ops():
    bars = [("gen", 0, d, 0.0, 1.0 + d / 100) for d in range(4)]
    bars += [("train", 0, d, 2.0, 3.0) for d in range(2, 4)]
    rows = plots.merge_rows(bars)
    labels = sorted({r[2] for r in rows})
    assert labels == ["devices 0-1", "devices 2-3"]
    gen = [r for r in rows if r[0] == "gen" and r[2] == "devices 2-3"]
    assert gen == [("gen", 0, "devices 2-3", 0.0, 1.03)]


def test_memory_chart_groups_a_large_cluster(tmp_path):
    peak = [70 * GB] * 96 + [30 * GB] * 160
    png, svg = plots.memory(peak, 96 * GB, tmp_path / "m")
    assert png.stat().st_size > 5000 and svg.stat().st_size > 5000
    assert plots.device_groups(peak) == [(0, 95, 70 * GB), (96, 255, 30 * GB)]


def test_spec_diff_with_cluster_prints_the_cost_sentence(tmp_path, capsys):
    from rpeg.cli import main

    root = __import__("pathlib").Path(__file__).resolve().parents[2] / "pipelines"
    variant = tmp_path / "sync.rpeg"
    variant.write_text(f'extend "{root / "tiny_ppo.rpeg"}"\npipeline tiny_sync\n\n'
                       "staleness rollout <= 0\n")
    rc = main(["diff", str(root / "tiny_ppo.rpeg"), str(variant), "--cluster",
               str(root / "clusters" / "local_cpu.rpeg"), "--budget", "100"])
    out = capsys.readouterr().out
    assert rc == 1, out
    sentence = next(x for x in out.splitlines() if x.startswith("staleness rollout 1 -> 0"))
    assert ": predicted step time " in sentence and ", peak memory " in sentence
    assert out.index(sentence) < out.index("predicted on local_cpu")
