"""Run a tutorial's ```sh blocks as written, in order, in one folder (tutorials 04 and 05).

Conventions (the same as tutorial 01's, plus two):

* a ```text block after a block's "prints" is its exact output (stdout and stderr
  together); a trailing ``# exit status N`` on a block's last line is the status it
  must end with (0 otherwise); any other failing command fails the block (bash -e);
* a block whose first line is ``# in a terminal of its own`` starts a long-running
  process (a Dask scheduler or worker): it is started in the background and stopped,
  with everything it started, when the tutorial ends;
* ``<!-- stop -->`` (where the text tells the reader to press Ctrl-C in those
  terminals) stops the background processes before the next block;
* ``<!-- smollm2 -->`` starts a part that needs the SmolLM2 weights: ``part`` counts
  the markers before a block.

``substitute`` replaces text in every block before it runs (a free port for 8786,
so that tests never collide with a scheduler someone else runs).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- smollm2 -->"
STOP = "<!-- stop -->"
BACKGROUND = "# in a terminal of its own"


@attrs.frozen
class Block:
    body: str
    expected: str | None
    status: int
    background: bool
    part: int
    stops: int = 0          # stop markers before the block


def _tutorial_01():
    """Tutorial 01's test module: its block parser is the one every tutorial follows."""
    spec = importlib.util.spec_from_file_location(
        "test_tutorial_01", Path(__file__).with_name("test_tutorial_01.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def blocks(text: str) -> list[Block]:
    t01 = _tutorial_01()
    starts = [m.start() for m in t01.FENCE.finditer(text) if m.group(1) == "sh"]
    out = []
    for (body, expected, status), start in zip(t01.blocks(text), starts, strict=True):
        lines = [x for x in body.splitlines() if x.strip()]
        # bash -e stops at the first failing command: only the last may fail on purpose
        assert not any("exit status" in x for x in lines[:-1]), f"put it last:\n{body}"
        first = lines[0]
        out.append(Block(body, expected, status, first.strip().startswith(BACKGROUND),
                         text[:start].count(MARKER), text[:start].count(STOP)))
    return out


def environment(tmp: Path) -> dict[str, str]:
    """PATH with ``rpeg``, ``python``, ``pip`` and ``dask`` from this interpreter."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, target in (("rpeg", "-m rpeg"), ("python", ""), ("pip", "-m pip"),
                         ("dask", "-m dask")):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" {target} "$@"\n')
        shim.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
                PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", COLUMNS="200", NO_COLOR="1")


class Session:
    """One shell working folder carried from block to block, and the background processes."""

    def __init__(self, tmp: Path, substitute: dict[str, str] | None = None) -> None:
        self.env = environment(tmp)
        self.work = tmp / "work"
        self.work.mkdir(exist_ok=True)
        self.state = tmp / "cwd"
        self.state.write_text(str(self.work))
        self.substitute = substitute or {}
        self.background: list[tuple[subprocess.Popen, Path]] = []
        self.ran: list[str] = []
        self.stops = 0

    @property
    def cwd(self) -> Path:
        return Path(self.state.read_text().strip())

    def run(self, block: Block, timeout: float = 600) -> str:
        body = block.body
        for old, new in self.substitute.items():
            body = body.replace(old, new)
        self.ran.append(block.body)
        if block.stops > self.stops:
            self.stops = block.stops
            self.close()
        if block.background:
            log = self.work.parent / f"background-{len(self.background)}.log"
            proc = subprocess.Popen(["bash", "-e", "-c", f'cd "{self.cwd}"\n{body}'],
                                    env=self.env, stdout=open(log, "w"),
                                    stderr=subprocess.STDOUT, start_new_session=True)
            self.background.append((proc, log))
            return ""
        script = f'cd "$(cat "{self.state}")"\ntrap \'pwd > "{self.state}"\' EXIT\n{body}'
        proc = subprocess.run(["bash", "-e", "-c", script], env=self.env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
        where = f"block:\n{body}\n--- output ---\n{proc.stdout}\n{self.logs()}"
        assert proc.returncode == block.status, where
        if block.expected is not None:
            assert proc.stdout == block.expected, where
        return proc.stdout

    def logs(self) -> str:
        return "\n".join(f"--- {log.name} ---\n{log.read_text()[-2000:]}"
                         for _, log in self.background if log.exists())

    def close(self) -> None:
        """Stop every background process group this session started (scheduler, workers)."""
        for proc, _ in self.background:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in self.background:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
