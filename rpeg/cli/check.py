"""``rpeg check FILE...``: parse and check pipelines, clusters and profiles.

    $ rpeg check pipelines/ppo_llama8b.rpeg pipelines/clusters/gh200_64.rpeg
    ok  pipelines/ppo_llama8b.rpeg  pipeline ppo_llama8b: 4 models, 7 stages
    ok  pipelines/clusters/gh200_64.rpeg  cluster gh200_64: 64 GPUs (gh200)

Checking takes time linear in the file's size (a spec of 4 MB is read in seconds), and the
output is bounded: a file's first ``--warnings`` warnings are shown, the rest counted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from rpeg.errors import RpegError
from rpeg.spec import FileKind, check_file


def summary(checked) -> str:
    v = checked.value
    if checked.kind is FileKind.PIPELINE:
        return f"pipeline {v.name}: {len(v.models)} models, {len(v.stages)} stages"
    if checked.kind is FileKind.CLUSTER:
        return f"cluster {v.name}: {v.num_gpus} GPUs ({v.gpu.name})"
    return f"profile {v.name}"


def register(app: typer.Typer) -> None:
    @app.command()
    def check(
        files: list[Path] = typer.Argument(..., help="Files to check (.rpeg)."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="Print errors only."),
        warnings: int = typer.Option(20, "--warnings", min=0, max=10_000,
                                     help="Show at most this many warnings per file (the "
                                          "rest are counted)."),
    ) -> None:
        """Check .rpeg files: syntax, names, dataflow, staleness, sharing, units."""
        failed = 0
        for f in files:
            try:
                checked = check_file(f)
            except RpegError as e:
                print(e.render(), file=sys.stderr)
                failed += 1
                continue
            if checked.kind is FileKind.PIPELINE:
                try:               # the datasets' first rows against the data contract
                    from rpeg.plan.pinned import check_eval_pins
                    from rpeg.plan.space import Limits
                    from rpeg.runtime.datacheck import check_data
                    check_eval_pins(checked.value, Limits.runtime())
                    unchecked = check_data(checked.value)
                except RpegError as e:
                    print(e.render(), file=sys.stderr)
                    failed += 1
                    continue
            else:
                unchecked = []
            shown = [] if quiet else list(checked.warnings) + unchecked     # errors only
            for w in shown[:warnings]:
                print(w.render(), file=sys.stderr)
            if len(shown) > warnings:
                print(f"{f}: ... and {len(shown) - warnings:,} more warnings "
                      "(rpeg check --warnings N shows more of them)", file=sys.stderr)
            if not quiet:
                print(f"ok  {f}  {summary(checked)}")
        if failed:
            raise typer.Exit(1)
