"""``rpeg calibrate --tools SPEC``: each tool's latency measured in the sandbox, the
distribution to declare, and a sandboxed call's own cost written into a profile."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_calibrate_measures_the_tools_and_updates_the_profile(tmp_path):
    for f in ("tiny_tools.rpeg", "tools.py", "rewards.py"):
        shutil.copy(ROOT / "pipelines" / f, tmp_path / f)
    (tmp_path / "data").mkdir()
    shutil.copy(ROOT / "pipelines" / "data" / "keys.jsonl", tmp_path / "data" / "keys.jsonl")
    profile = tmp_path / "p.rpeg"
    shutil.copy(ROOT / "pipelines" / "clusters" / "profiles" / "local_cpu.rpeg", profile)
    before = profile.read_text()
    r = subprocess.run([sys.executable, "-m", "rpeg", "calibrate", "--tools",
                        str(tmp_path / "tiny_tools.rpeg"), "--arg", "abc", "--calls", "5",
                        "-o", str(profile)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert re.search(r"tool k: 5 calls, median [\d.]+ ms", r.stderr), r.stderr
    assert re.fullmatch(r"  declare: latency = lognormal\(median = [\d.]+ m?s, max = [\d.]+ "
                        r"m?s\)\n", r.stdout), r.stdout
    after = profile.read_text()
    assert after != before and re.search(r"tool_call_s\s*=\s*[\d.]+ m?s", after)
    from rpeg.spec.cluster import load_profile
    assert 0 < load_profile(profile).tool_call_s < 5
