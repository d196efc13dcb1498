"""``rpeg help functions``: the language reference, generated from the registry.

    $ rpeg help functions
    Functions of the .rpeg language (generated from rpeg/spec/functions.py).
    ...
    $ rpeg help functions gae          # one function
    $ rpeg help functions --markdown   # README's list of algorithms
"""

from __future__ import annotations

import typer

TOPICS = ("functions",)


def register(app: typer.Typer) -> None:
    @app.command(name="help")
    def help_(
        topic: str = typer.Argument(..., help="What to describe: functions."),
        name: str = typer.Argument(None, help="One function (e.g. gae, ppo_clip)."),
        markdown: bool = typer.Option(False, "--markdown",
                                      help="README's list of estimators and losses."),
    ) -> None:
        """Print the language reference: every function, its keywords, defaults and meaning."""
        import click

        from rpeg.errors import did_you_mean
        from rpeg.spec.functions import FUNCTIONS, find
        from rpeg.spec.reference import algorithms_markdown, describe, reference
        if topic not in TOPICS:
            raise click.UsageError(f"topic must be one of {', '.join(TOPICS)}, not {topic!r}"
                                   + (f"; {did_you_mean(topic, TOPICS)}"
                                      if did_you_mean(topic, TOPICS) else ""))
        if markdown:
            print(algorithms_markdown(), end="")
            return
        if name is None:
            print(reference(), end="")
            return
        fn = find(name)
        if fn is None:
            hint = did_you_mean(name, [f.name for f in FUNCTIONS])
            raise click.UsageError(f"function must be one of the registry's, not {name!r}"
                                   + (f"; {hint}" if hint else "")
                                   + " (rpeg help functions lists them)")
        print("\n".join(describe(fn)))
