"""``rpeg fmt FILE... [--check | --write]``: the canonical form of .rpeg files.

    $ rpeg fmt pipelines/ppo_llama8b.rpeg            # canonical text to stdout
    $ rpeg fmt --check pipelines/*.rpeg              # exit 1 naming each file not canonical
    $ rpeg fmt -w my.rpeg                            # rewrite in place
    $ rpeg fmt - < my.rpeg                           # stdin to stdout (for editors)

Formatting needs only the syntax: a file with a semantic error (an unknown
model, say) is still formatted; a syntax error is reported like ``rpeg check``
does and exits 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from rpeg.cli.output import writing
from rpeg.errors import RpegError
from rpeg.spec.parser import parse_bytes, parse_file
from rpeg.spec.printer import fmt


def _original(path: Path) -> str:
    text = path.read_bytes().decode("utf-8")
    return text[1:] if text.startswith("\ufeff") else text


def register(app: typer.Typer) -> None:
    @app.command("fmt")
    def fmt_command(
        files: list[Path] = typer.Argument(..., help="Files to format (.rpeg); '-' for stdin."),
        check: bool = typer.Option(False, "--check",
                                   help="Change nothing; exit 1 if a file is not canonical."),
        write: bool = typer.Option(False, "--write", "-w", help="Rewrite the files in place."),
    ) -> None:
        """Print .rpeg files in canonical form (aligned, comments kept)."""
        if check and write:
            print("rpeg fmt: --check and --write exclude each other", file=sys.stderr)
            raise typer.Exit(2)
        failed = 0
        not_canonical: list[Path] = []
        for path in files:
            if str(path) == "-":
                if write:
                    print("rpeg fmt: --write rewrites files; standard input is none",
                          file=sys.stderr)
                    raise typer.Exit(2)
                raw = sys.stdin.buffer.read()
                try:
                    text = fmt(parse_bytes(raw, "<stdin>"))
                except RpegError as e:
                    print(e.render(source=raw.decode("utf-8", errors="replace")), file=sys.stderr)
                    failed += 1
                    continue
                if not check:
                    sys.stdout.write(text)
                elif raw.decode("utf-8", errors="replace") != text:
                    not_canonical.append(path)
                    print("<stdin>: not in canonical form", file=sys.stderr)
                continue
            try:
                parsed = parse_file(path)
            except RpegError as e:
                print(e.render(), file=sys.stderr)
                failed += 1
                continue
            text = fmt(parsed)
            if check:
                if _original(path) != text:
                    not_canonical.append(path)
                    print(f"{path}: not in canonical form (run 'rpeg fmt -w {path}')",
                          file=sys.stderr)
            elif write:
                if _original(path) != text:
                    with writing(path.resolve(), "the formatted file") as tmp:  # the link's file
                        tmp.write_text(text, encoding="utf-8")
                    print(f"formatted {path}", file=sys.stderr)
            else:
                sys.stdout.write(text)
        if failed or not_canonical:
            raise typer.Exit(1)
