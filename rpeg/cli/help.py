"""``rpeg help``: the language reference, generated from the registries the checker reads.

    $ rpeg help                        # the topics
    $ rpeg help workload               # every key of the workload block
    $ rpeg help workload gen_len       # one key
    $ rpeg help functions gae          # one function
    $ rpeg help presets qwen3-8b       # one preset's dimensions
    $ rpeg help place --markdown       # a topic as markdown
    $ rpeg help --markdown             # the whole reference: docs/reference.md
"""

from __future__ import annotations

import typer

from rpeg.spec.presets import ModelDims


def backend_builds(dims: ModelDims) -> str:
    """Whether ``rpeg run``'s backend builds a model of ``dims``, and if not, what it lacks:
    the runtime's declaration (``rpeg.plan.capabilities``), which imports no torch."""
    from rpeg.plan.capabilities import runtime_capabilities

    caps = runtime_capabilities()
    lacks = [] if dims.family.value in caps.families else [f"the {dims.family.value} family"]
    lacks += sorted(dims.features() - caps.model_features)
    return "yes" if not lacks else "no: " + ", ".join(lacks)


def register(app: typer.Typer) -> None:
    @app.command(name="help")
    def help_(
        topic: str = typer.Argument(None, help="What to describe (rpeg help lists the "
                                               "topics): functions, presets, workload, ..."),
        name: str = typer.Argument(None, help="One function, key, section or preset."),
        markdown: bool = typer.Option(False, "--markdown",
                                      help="As markdown (without a topic: docs/reference.md)."),
    ) -> None:
        """Print the language reference: every key and function, its type, range, default,
        unit and meaning, from the registries the checker reads."""
        import click

        from rpeg.spec import topics

        if topic is None:
            if name is None:
                print(topics.markdown(backend_builds) if markdown else topics.listing(), end="")
                return
        if topics.topic(topic) is None and name is None:
            # a section or key of one topic named alone (rpeg help lora: rpeg help model lora)
            parent = next((t.name for t in topics.TOPICS
                           if topic in topics.items(t.name)), None)
            if parent is not None:
                topic, name = parent, topic
        if topics.topic(topic) is None:
            hint = topics.topic_hint(topic)
            raise click.UsageError(f"topic must be one of "
                                   f"{', '.join(t.name for t in topics.TOPICS)}, not {topic!r}"
                                   + (f"; {hint}" if hint else ""))
        try:
            print(topics.topic_markdown_text(topic, name, backend_builds) if markdown
                  else topics.text(topic, name, backend_builds), end="")
        except KeyError:
            from rpeg.errors import did_you_mean
            from rpeg.spec.vocabulary import foreign_hint
            hint = foreign_hint(name, topics.items(topic)) or did_you_mean(name,
                                                                           topics.items(topic))
            raise click.UsageError(f"{name!r} must be one of what rpeg help {topic} lists, and "
                                   "it is not" + (f"; {hint}" if hint else "")) from None
