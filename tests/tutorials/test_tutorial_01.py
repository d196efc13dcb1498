"""Tutorial 01 runs as written: every ```sh block, in order, in one fresh folder.

A ```text block after a block's "prints" is its exact output (stdout and
stderr together); "prints nothing" means empty output. A trailing
``# exit status N`` on a block's last command is the status it must end with
(0 otherwise); any other command failing fails the block (``bash -e``).
```output blocks are illustrations and are not compared.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "tutorials" / "01-first-pipeline.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)


def blocks(text: str) -> list[tuple[str, str | None, int]]:
    """(script, expected output or None, expected exit status) for every sh block."""
    fences = [(m.group(1), m.group(2), m.start(), m.end()) for m in FENCE.finditer(text)]
    out = []
    for n, (lang, body, _start, end) in enumerate(fences):
        if lang != "sh":
            continue
        nxt = fences[n + 1] if n + 1 < len(fences) else None
        prose = text[end:nxt[2] if nxt else len(text)].strip()
        expected = None
        if prose.startswith("prints nothing"):
            expected = ""
        elif prose == "prints" and nxt is not None and nxt[0] == "text":
            expected = nxt[1]
        lines = [x for x in body.splitlines() if x.strip()]
        m = re.search(r"#\s*exit status (\d+)\s*$", lines[-1])
        status = int(m.group(1)) if m else 0
        out.append((body, expected, status))
    return out


def test_tutorial_has_the_steps_the_issue_asks_for():
    text = TUTORIAL.read_text(encoding="utf-8")
    for command in ("rpeg check", "rpeg fmt", "rpeg graph", "rpeg diff", "error:"):
        assert command in text
    assert len(blocks(text)) >= 10


@pytest.mark.skipif(shutil.which("dot") is None,
                    reason="the tutorial draws with graphviz's dot, which is not installed "
                           "(Debian: apt-get install graphviz)")
def test_tutorial_runs_as_written(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "rpeg"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m rpeg "$@"\n')
    shim.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    state = tmp_path / "cwd"
    state.write_text(str(work))
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", COLUMNS="200", NO_COLOR="1")
    for n, (body, expected, status) in enumerate(blocks(TUTORIAL.read_text(encoding="utf-8"))):
        script = f'cd "$(cat "{state}")"\ntrap \'pwd > "{state}"\' EXIT\n{body}'
        proc = subprocess.run(["bash", "-e", "-c", script], env=env, capture_output=False,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=120)
        where = f"block {n + 1}:\n{body}\n--- output ---\n{proc.stdout}"
        assert proc.returncode == status, where
        if expected is not None:
            assert proc.stdout == expected, where
    svg = Path(state.read_text().strip()) / "first.svg"
    assert svg.stat().st_size > 5000 and "cluster_step2" in svg.read_text()
