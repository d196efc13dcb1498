"""``rpeg verify RUN_DIR``: check a run's trace against its plan; exit 1 on any violation.

    $ rpeg verify runs/tiny_ppo-20261130-011500
    verified 842 ops of 60 steps: placement, dependencies, versions - ok

A run with violations is summarised (how many of each check), its first ``--violations``
(20) listed and the rest counted: the output is bounded however damaged the run.
"""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def verify(
        run_dir: Path = typer.Argument(..., help="A run directory written by rpeg run."),
        violations: int = typer.Option(20, "--violations", min=0, max=10_000,
                                       help="List at most this many violations (the rest "
                                            "are counted)."),
    ) -> None:
        """Check a run: every op on its planned devices, dependencies in order, versions in bounds."""
        from rpeg.runtime.verify import verify_run

        report = verify_run(run_dir)
        print(report.text(violations))
        if not report.ok:
            raise typer.Exit(1)
