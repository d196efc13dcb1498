"""The ``rpeg`` command line: one module per command, each with ``register(app)``.

    $ rpeg check pipelines/*.rpeg
    $ rpeg compile pipelines/ppo_llama8b.rpeg --cluster pipelines/clusters/gh200_64.rpeg

Exit status: 0 success, 1 invalid input or a failed check, 2 usage error. A user
mistake is printed as ``FILE:LINE:COL: error: ...`` with the line and a caret;
never as a Python traceback (set RPEG_DEBUG=1 to see one for a bug in rpeg).
"""

from __future__ import annotations

import importlib
import os
import sys

import typer

from rpeg.errors import RpegError

COMMANDS = ("check", "fmt", "graph", "compile", "simulate", "diff", "run", "verify", "show",
            "export", "calibrate", "help")

app = typer.Typer(
    name="rpeg",
    help="Compile, plan, run and verify reinforcement-learning pipelines for language models.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        from rpeg import __version__
        print(f"rpeg {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True,
                                       callback=_print_version,
                                       help="Print rpeg's version and exit.")) -> None:
    """Compile, plan, run and verify reinforcement-learning pipelines for language models."""


def _register_all(only: str | None = None) -> None:
    """Register every command, or only ``only`` when it names one (not ``help``, which
    lists them all): ``rpeg compile`` then imports the compile path alone, not the
    runtime's modules that ``rpeg run`` needs."""
    # every command is a module of this package: one that is missing is a broken install,
    # said as such, not a command silently gone from --help
    app.registered_commands.clear()          # registering again replaces, never duplicates
    for name in (only,) if only in COMMANDS and only != "help" else COMMANDS:
        module = f"rpeg.cli.{name}"
        try:
            importlib.import_module(module).register(app)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            raise RpegError(f"rpeg's '{name}' command must be installed, not missing "
                            f"(no module {module})", hint="reinstall rpeg") from None


def _command(argv: list[str]) -> str | None:
    """The command ``argv`` names: its first word that is not an option."""
    return next((a for a in argv if not a.startswith("-")), None)


def report(err: RpegError) -> None:
    """Print a diagnostic to stderr in the compiler format."""
    # an error in a command-line override shows the override (rpeg.spec.overrides)
    print(err.render(source=getattr(err, "source_text", None)), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    try:
        _register_all(_command(sys.argv[1:] if argv is None else argv))
        rc = app(args=argv, standalone_mode=False)
    except RpegError as e:
        report(e)
        return 1
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 — the one place a bug in rpeg is turned into a message
        # typer bundles its own click: recognise its usage errors by shape, not by class
        if hasattr(e, "show") and hasattr(e, "exit_code"):
            e.show()
            return int(e.exit_code)
        if type(e).__name__ == "Abort":
            print("aborted", file=sys.stderr)
            return 1
        if os.environ.get("RPEG_DEBUG"):
            raise
        print(f"rpeg: internal error: {type(e).__name__}: {e}\n"
              "This is a bug in rpeg, not in your input; rerun with RPEG_DEBUG=1 for details.",
              file=sys.stderr)
        return 3
    return rc if isinstance(rc, int) else 0


def run() -> None:
    sys.exit(main())
