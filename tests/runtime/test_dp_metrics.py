"""A train step's metrics are the step's whatever its data-parallel degree: the same GRPO
update on one device and on two (minibatches = 1, staleness 0: the same samples, the same
update up to float rounding) reports the same policy loss, entropy and KL. Each rank's
share of the loss terms is averaged over the ranks (``executor._over_ranks``); metrics.jsonl
took rank 0's share times the ranks as the step's (policy loss -0.104 on two devices where
one gave 0.016, grad_norm the same)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rpeg.cli import main

pytestmark = pytest.mark.slow

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"
LOCAL = PIPELINES / "clusters" / "local_cpu.rpeg"
PINS = """
place rollout on gpus 0..0 {{ dp = 1 }}
place ref_lp on gpus 0..0 {{ dp = 1; microbatches = 1 }}
place actor_step on gpus 0..{last} {{ dp = {dp}; microbatches = 1; zero = 0; packing = false }}
"""


def _metrics(folder: Path, dp: int) -> list[dict]:
    text = (PIPELINES / "tiny_grpo.rpeg").read_text().replace("minibatches = 2",
                                                             "minibatches = 1")
    spec = folder / f"dp{dp}.rpeg"
    spec.write_text(text + PINS.format(last=dp - 1, dp=dp))
    plan = folder / f"dp{dp}.json"
    assert main(["compile", str(spec), "--cluster", str(LOCAL), "--strategy", "pinned",
                 "-o", str(plan), "--no-gantt"]) == 0
    run = folder / f"run{dp}"
    assert main(["run", str(plan), "--steps", "2", "--staleness", "0", "--no-progress",
                 "--run-dir", str(run)]) == 0
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_train_metrics_do_not_depend_on_the_data_parallel_degree(tmp_path):
    (tmp_path / "data").symlink_to(PIPELINES / "data")
    shutil.copy(PIPELINES / "rewards.py", tmp_path / "rewards.py")
    one, two = _metrics(tmp_path, 1), _metrics(tmp_path, 2)
    a, b = one[0], two[0]                       # step 0: the same weights, the same samples
    assert a["reward"] == b["reward"]
    grad = [k for k in a if k.startswith("grad_norm")]
    assert grad and all(a[k] == pytest.approx(b[k], rel=1e-4) for k in grad)
    # float32 sums over 64 responses in another order: rounding of terms of order 1
    for key in [k for k in a if k.split(".")[0] in ("policy_loss", "entropy", "kl", "loss")]:
        assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), (key, a[key], b[key])
