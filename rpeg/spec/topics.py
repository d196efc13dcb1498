"""``rpeg help TOPIC``: the language reference, generated from the registries the checker reads.

    >>> [t.name for t in TOPICS][:4]
    ['functions', 'presets', 'workload', 'data']
    >>> "gen_len" in text("workload") and "uniform(min = A, max = B)" in text("workload")
    True
    >>> print(text("cluster", "racks"), end="")
      racks          integer [1, 1048576]; default 1
                     racks

Each topic prints the keys of its sections (``rpeg.spec.keys``) or the functions of the
registry (``rpeg.spec.functions``), the model presets (``rpeg.spec.presets``) or the names
other systems use (``rpeg.spec.vocabulary``): a key the checker accepts is a key printed
here, with the range it is checked against. ``markdown()`` is ``docs/reference.md`` (a
test keeps the file equal to it). What the backend builds of a preset is the runtime's
declaration, which this layer does not read: the caller passes it as ``builds``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable

import attrs

from rpeg.errors import did_you_mean
from rpeg.spec import keys as K
from rpeg.spec.functions import FUNCTIONS, by_category, find
from rpeg.spec.presets import PRESETS, ModelDims
from rpeg.spec.reference import (
    WIDTH,
    default_text,
    describe,
    facts,
    kind_text,
    notes,
    param_lines,
    reference,
)
from rpeg.spec.reference import signature as fn_signature
from rpeg.spec.registry import Category, Function, Param
from rpeg.spec.vocabulary import FOREIGN

Builds = Callable[[ModelDims], str]


@attrs.frozen
class Topic:
    name: str
    summary: str
    sections: tuple[K.Section, ...] = ()     # the topic's keys; none for the special ones


def _topics() -> tuple[Topic, ...]:
    return (
        Topic("functions", "stage functions, advantage estimators, losses, rewards and "
                           "optimizers, with their keywords"),
        Topic("presets", "model presets: dimensions, parameters, context, head_dim, family, "
                         "and whether rpeg's backend builds them"),
        Topic("workload", "the workload block: steps, prompts, samples, lengths and their "
                          "distributions", (K.WORKLOAD, *K.DISTRIBUTIONS)),
        Topic("data", "the workload's data keys: the dataset, its columns and template",
              (K.DATA,)),
        Topic("model", "a model block: optimizer, head, dtype, weights, LoRA and the "
                       "architecture's keys", (K.MODEL, K.ARCHITECTURE, K.LORA)),
        Topic("eval", "the eval block: held-out prompts every N steps", (K.EVAL,)),
        Topic("log", "the log block: trackers, sampled responses kept", (K.LOG,)),
        Topic("place", "place STAGE on gpus A..B { ... }: a stage's pinned layout", (K.PLACE,)),
        Topic("cluster", "a cluster file: devices, nodes, racks and their links",
              (K.CLUSTER, K.LINK)),
        Topic("profile", "a device profile: every figure the cost model reads, with its unit",
              (K.profile_section(),)),
        Topic("vocabulary", "names from verl, OpenRLHF, NeMo-RL and TRL, and rpeg's key for "
                            "each"),
    )


TOPICS = _topics()


def topic(name: str) -> Topic | None:
    return next((t for t in TOPICS if t.name == name), None)


def topic_hint(name: str) -> str:
    return did_you_mean(name, [t.name for t in TOPICS]) or ""


# --- text ---------------------------------------------------------------------------------

def listing() -> str:
    """``rpeg help``: the topics."""
    lines = ["rpeg help TOPIC [NAME] [--markdown]: the language reference, generated from the "
             "registries the checker reads.", "", "Topics:"]
    for t in TOPICS:
        lines += textwrap.wrap(t.summary, WIDTH, initial_indent=f"  {t.name:<12} ",
                               subsequent_indent=" " * 15)
    lines += ["", "rpeg help --markdown prints the whole reference (docs/reference.md)."]
    return "\n".join(lines) + "\n"


def text(name: str, item: str | None = None, builds: Builds | None = None) -> str:
    """``rpeg help NAME [ITEM]``; KeyError naming what is missing when ``item`` is not in it."""
    t = topic(name)
    if t is None:
        raise KeyError(name)
    if t.name == "functions":
        if item is None:
            return reference()
        fn = find(item)
        if fn is None:
            raise KeyError(item)
        return "\n".join(describe(fn)) + "\n"
    if t.name == "presets":
        return presets_text(item, builds)
    if t.name == "vocabulary":
        return vocabulary_text(item)
    if item is None:
        head = [f"{t.name}: {t.summary} (generated from rpeg/spec/keys.py)."]
        return "\n".join(head + [line for s in t.sections for line in [""] + section_lines(s)]
                         ) + "\n"
    for s in t.sections:
        if s.name == item:
            return "\n".join(section_lines(s)) + "\n"
    for s in t.sections:
        if s.has(item):
            return "\n".join(param_lines(s.param(item), indent=2)) + "\n"
    raise KeyError(item)


def items(name: str) -> list[str]:
    """What ``rpeg help NAME ITEM`` may name: for did-you-mean."""
    t = topic(name)
    if t is None:
        return []
    if t.name == "functions":
        return [f.name for f in FUNCTIONS]
    if t.name == "presets":
        return list(PRESETS)
    if t.name == "vocabulary":
        return [n for f in FOREIGN for n in f.names]
    return [s.name for s in t.sections] + [k for s in t.sections for k in s.keys]


def section_lines(s: K.Section) -> list[str]:
    lines = [f"  {s.form}"]
    lines += textwrap.wrap(s.doc, WIDTH, initial_indent="      ", subsequent_indent="      ")
    for p in s.params:
        lines += param_lines(p)
    return lines


# --- presets -------------------------------------------------------------------------------

PRESETS_DOC = ("A preset is an architecture, from the family's published config.json: a base "
               "model and its instruct variant share it (llama3.1-8b is Llama-3.1-8B and "
               "Llama-3.1-8B-Instruct). The weights come from a folder: weights = \"FOLDER\" "
               "beside the preset, or hf(\"FOLDER\") instead of it. Every preset is priced "
               "by the cost model; 'runs' says whether rpeg run's backend builds it.")
_COLUMNS = ("preset", "family", "params", "active", "layers", "hidden", "heads", "kv",
            "head_dim", "ffn", "vocab", "context", "runs")


def preset_row(name: str, d: ModelDims, builds: Builds | None) -> tuple[str, ...]:
    return (name, d.family.value, _billions(d.param_count()),
            _billions(d.active_param_count()) if d.moe else "-", str(d.layers), str(d.hidden),
            str(d.heads), str(d.kv_heads), str(d.head_dim), str(d.ffn or d.expert_ffn),
            str(d.vocab), _context(d.max_positions), builds(d) if builds else "-")


def presets_text(name: str | None = None, builds: Builds | None = None) -> str:
    if name is not None:
        if name not in PRESETS:
            raise KeyError(name)
        return "\n".join(preset_detail(name, PRESETS[name], builds)) + "\n"
    rows = [_COLUMNS] + [preset_row(n, d, builds) for n, d in PRESETS.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["Model presets (generated from rpeg/spec/presets.py).", ""]
    lines += textwrap.wrap(PRESETS_DOC, WIDTH)
    lines += ["", "params: parameters in all (every expert); active: a token's (mixtures of "
                  "experts); ffn: an expert's MLP where the model has experts.", ""]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]
    return "\n".join(lines) + "\n"


def preset_detail(name: str, d: ModelDims, builds: Builds | None) -> list[str]:
    return [f"  {name}"] + [f"      {k:<22} {v}" for k, v in preset_facts(d, builds)]


def preset_facts(d: ModelDims, builds: Builds | None) -> list[tuple[str, object]]:
    """A preset's dimensions and what follows from them, in the order the reference shows."""
    facts = [("family", d.family.value), ("parameters", f"{d.param_count():,}"),
             ("active per token", f"{d.active_param_count():,}" if d.moe else "all"),
             ("layers", d.layers), ("hidden", d.hidden), ("heads", d.heads),
             ("kv_heads", d.kv_heads), ("head_dim", d.head_dim), ("ffn", d.ffn),
             ("vocab", d.vocab), ("context", f"{d.max_positions:,} positions"),
             ("tied embeddings", _yes(d.tied_embeddings)), ("qkv bias", _yes(d.qkv_bias)),
             ("qk_norm", _yes(d.qk_norm)), ("mlp", "gated" if d.gated else "plain")]
    if d.moe:
        facts += [("experts", d.experts), ("active_experts", d.active_experts),
                  ("shared_experts", d.shared_experts), ("expert_ffn", d.expert_ffn),
                  ("dense_layers", d.dense_layers)]
    if d.mla:
        facts += [("kv_lora", d.kv_lora), ("q_lora", d.q_lora), ("rope_dim", d.rope_dim),
                  ("v_head", d.v_head)]
    facts += [("KV cache per token", f"{d.kv_bytes_per_token(2):,} bytes (bf16)"),
              ("beyond a dense block", ", ".join(sorted(d.features())) or "nothing")]
    if builds is not None:
        facts.append(("rpeg run builds it", builds(d)))
    return facts


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def _context(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


# --- the vocabulary ---------------------------------------------------------------------------

def vocabulary_text(name: str | None = None) -> str:
    entries = FOREIGN
    if name is not None:
        entries = tuple(f for f in FOREIGN if name in f.names)
        if not entries:
            raise KeyError(name)
    lines = ["Names other systems use, and rpeg's (generated from rpeg/spec/vocabulary.py); "
             "rpeg check gives the same hint where one is written.", ""]
    for f in entries:
        lines += textwrap.wrap(", ".join(f.names), WIDTH, initial_indent="  ",
                               subsequent_indent="    ")
        lines += textwrap.wrap(f"{f.systems} names for {f.what}; in rpeg: {f.how}", WIDTH,
                               initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines) + "\n"


# --- markdown -------------------------------------------------------------------------------

def _cell(x: object) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def param_table(params: tuple[Param, ...], word: str = "key") -> list[str]:
    rows = [f"| {word} | type | default | meaning |", "|---|---|---|---|"]
    for p in params:
        said = notes(p)
        meaning = p.doc + (f" ({'; '.join(said)})" if said else "")
        rows.append(f"| `{p.name}` | {_cell(kind_text(p))} | "
                    f"{_cell(default_text(p).removeprefix('default '))} | "
                    f"{_cell(meaning)} |")
    return rows


def section_markdown(s: K.Section, level: str = "###") -> list[str]:
    out = [f"{level} {s.name}", "", f"`{s.form}`", "", s.doc, ""]
    if s.params:
        out += param_table(s.params) + [""]
    return out


def function_markdown(fn: Function) -> list[str]:
    out = [f"#### {fn.name}", "", f"`{fn_signature(fn)}`", "", fn.doc, "", facts(fn) + ".", ""]
    if fn.params:
        out += param_table(fn.params, "keyword") + [""]
    out += [f"- `{key}`: not here — {where}" for key, where in fn.moved]
    return out + ([""] if fn.moved else [])


def _categories() -> list[tuple[Category, str]]:
    """Every category of the registry, titled as ``rpeg help functions`` titles it."""
    from rpeg.spec import reference as R
    titles = {c: title for c, title, _ in R._SECTIONS}
    return [(c, titles.get(c, c.value.capitalize() + "s")) for c in Category]


def topic_markdown(t: Topic, builds: Builds | None = None) -> list[str]:
    out = [f"## {t.name}", "", f"`rpeg help {t.name}`: {t.summary}.", ""]
    if t.name == "functions":
        for category, title in _categories():
            out += [f"### {title}", ""]
            for fn in by_category(category):
                out += function_markdown(fn)
        return out
    if t.name == "presets":
        out += [PRESETS_DOC, "", "| " + " | ".join(_COLUMNS) + " |",
                "|" + "---|" * len(_COLUMNS)]
        out += ["| " + " | ".join(_cell(c) for c in preset_row(n, d, builds)) + " |"
                for n, d in PRESETS.items()]
        return out + [""]
    if t.name == "vocabulary":
        out += ["| names | whose | rpeg |", "|---|---|---|"]
        out += [f"| {', '.join(f'`{n}`' for n in f.names)} | {_cell(f.systems)} | "
                f"{_cell(f.how)} |" for f in FOREIGN]
        return out + [""]
    for s in t.sections:
        out += section_markdown(s)
    return out


def markdown(builds: Builds | None = None) -> str:
    """The whole reference: ``docs/reference.md``."""
    out = ["# The .rpeg language reference", "",
           "Generated by `rpeg help --markdown` from the registries the checker reads "
           "(`rpeg/spec/functions.py`, `rpeg/spec/keys.py`, `rpeg/spec/presets.py`, "
           "`rpeg/spec/vocabulary.py`); `python scripts/update_docs.py` rewrites this file. "
           "Do not edit it by hand.", ""]
    out += [f"- [{t.name}](#{t.name}): {t.summary}" for t in TOPICS] + [""]
    for t in TOPICS:
        out += topic_markdown(t, builds)
    return "\n".join(out).rstrip() + "\n"


def topic_markdown_text(name: str, item: str | None = None,
                        builds: Builds | None = None) -> str:
    """``rpeg help NAME [ITEM] --markdown``; KeyError naming what is missing."""
    t = topic(name)
    if t is None:
        raise KeyError(name)
    if item is None:
        out = topic_markdown(t, builds)
    elif t.name == "functions":
        fn = find(item)
        if fn is None:
            raise KeyError(item)
        out = function_markdown(fn)
    elif t.name == "presets":
        if item not in PRESETS:
            raise KeyError(item)
        out = [f"#### {item}", ""] + [f"- {k}: {v}" for k, v in
                                      preset_facts(PRESETS[item], builds)]
    elif t.name == "vocabulary":
        entries = [f for f in FOREIGN if item in f.names]
        if not entries:
            raise KeyError(item)
        out = [f"`{item}`: {entries[0].systems} names for {entries[0].what}; in rpeg: "
               f"{entries[0].how}"]
    else:
        out = _section_item_markdown(t, item)
    return "\n".join(out).rstrip() + "\n"


def _section_item_markdown(t: Topic, item: str) -> list[str]:
    for s in t.sections:
        if s.name == item:
            return section_markdown(s)
    for s in t.sections:
        if s.has(item):
            return param_table((s.param(item),))
    raise KeyError(item)


__all__ = ["TOPICS", "Topic", "topic", "listing", "text", "items", "markdown",
           "topic_markdown_text", "presets_text", "vocabulary_text"]
