"""The blocks' keys, both ways: every key of the registry (``rpeg.spec.keys``) is documented
by ``rpeg help`` and accepted by the checker, and every name the checker accepts in a block
is one of the registry's -- found by offering the checker every name its own source
mentions, in every block, and asking which it takes."""

from __future__ import annotations

import ast as pyast
import re
from pathlib import Path

import attrs
import pytest

from rpeg.errors import SpecError
from rpeg.spec import ast as spec_ast
from rpeg.spec import check_file, keys
from rpeg.spec.cluster import lower_cluster, lower_profile
from rpeg.spec.lower import lower_pipeline
from rpeg.spec.model import GpuProfile, OpKind
from rpeg.spec.parser import parse_text
from rpeg.spec.presets import PRESETS
from rpeg.spec.registry import Param, Type
from rpeg.spec.topics import TOPICS, text
from rpeg.spec.vocabulary import FOREIGN

ROOT = Path(__file__).resolve().parents[2]

PIPELINE = """\
pipeline p
workload {
    steps = 2
    prompts = 2
    samples = 2
    prompt_len = 8
    gen_len = GEN_LEN
    WORKLOAD
}
model actor : tiny { optimizer = adam(lr = 1e-3) }
model ref : tiny { frozen }
model extra : tiny { MODEL }
reward long = overlong(max_len = 16)
stage rollout = generate(actor, prompts) -> responses, logprobs
stage ref_lp = forward(ref, responses) -> ref_logprobs
stage scores = score(long, responses) -> scores
stage adv = group_norm(scores) -> advantages
stage actor_step = train(actor, responses, advantages, logprobs, ref_logprobs, loss = grpo(0.2))
EXTRA
"""
CLUSTER = """\
cluster c {
    gpu cpu { memory = 1 GB; matmul_flops = 1 TFLOPS; mem_bandwidth = 10 GB/s }
    gpus_per_node = 2
    link gpu { bandwidth = 1 GB/s; latency = 200 us LINK }
    CLUSTER
}
"""
PROFILE = ("profile x {\n    memory = 1 GB\n    matmul_flops = 1 TFLOPS\n"
           "    mem_bandwidth = 10 GB/s\n    PROFILE\n}\n")
TINY = PRESETS["tiny"]
# an architecture key's value that keeps the tiny preset what it is
ARCH_VALUES = {"layers": TINY.layers, "hidden": TINY.hidden, "heads": TINY.heads,
               "kv_heads": TINY.kv_heads, "ffn": TINY.ffn, "vocab": TINY.vocab,
               "head_dim": TINY.head_dim, "dense_layers": 0}
# keys that take effect only with others: checked together
COMPANIONS = {
    "experts": "experts = 4; active_experts = 2; expert_ffn = 32",
    "active_experts": "experts = 4; active_experts = 2; expert_ffn = 32",
    "expert_ffn": "experts = 4; active_experts = 2; expert_ffn = 32",
    "shared_experts": "experts = 4; active_experts = 2; expert_ffn = 32; shared_experts = 1",
    "dense_layers": "experts = 4; active_experts = 2; expert_ffn = 32; dense_layers = 1",
    "kv_lora": "kv_lora = 32; rope_dim = 8; v_head = 16",
    "q_lora": "kv_lora = 32; q_lora = 32; rope_dim = 8; v_head = 16",
    "rope_dim": "kv_lora = 32; rope_dim = 8; v_head = 16",
    "v_head": "kv_lora = 32; rope_dim = 8; v_head = 16",
}


def example(p: Param) -> str:
    """A value of ``p`` as written in a spec, inside its documented range."""
    if p.name in ARCH_VALUES:
        return str(ARCH_VALUES[p.name])
    if p.example:
        return p.example
    if p.type in (Type.CHOICE, Type.BOOL):
        return str(p.default) if p.default is not None and p.type is Type.CHOICE \
            else p.choices[0] if p.choices else "true"
    if p.type is Type.INT:
        return str(p.default if isinstance(p.default, int) and not isinstance(p.default, bool)
                   else int(p.low or 1))
    if p.type is Type.REAL:
        if isinstance(p.default, float):
            return repr(p.default)
        return str((p.low + p.high) / 2 if p.low is not None and p.high is not None else 1.0)
    raise AssertionError(f"{p.name}: give it an example in rpeg/spec/keys.py")


def _pipeline(**parts: str) -> str:
    out = PIPELINE
    for slot in ("GEN_LEN", "WORKLOAD", "MODEL", "EXTRA"):
        out = out.replace(slot, parts.get(slot.lower(), "uniform(min = 1, max = 16)"
                                           if slot == "GEN_LEN" else ""))
    return out


def _entry(p: Param) -> str:
    return p.name if p.type is Type.FLAG else f"{p.name} = {example(p)}"


def _specs(tmp_path: Path):
    """(section, key, file text, file name) for every key of every section."""
    (tmp_path / "h.csv").write_text("4,1\n8,2\n16,1\n")
    for p in keys.WORKLOAD_BLOCK.params:
        given = re.search(rf"^    {p.name} = ", PIPELINE, re.M)      # the base sets it
        entry = "" if given else _entry(p)
        if p.name in keys.DATA.keys and p.name != "dataset":   # what reads a dataset's rows:
            entry = f'dataset = "data/saved"; {entry}'         # with one (a saved folder)
        yield "workload", p.name, _pipeline(workload=entry), "p.rpeg"
    for p in keys.MODEL_BLOCK.params:
        body = COMPANIONS.get(p.name, _entry(p))
        yield "model", p.name, _pipeline(model=body), "p.rpeg"
    for p in keys.LORA.params:
        rank = "" if p.name == "rank" else "rank = 8, "
        yield "lora", p.name, _pipeline(model=f"lora = lora({rank}{p.name} = {example(p)})"), \
            "p.rpeg"
    forms = {"fixed": "fixed(n = 16)", "uniform": "uniform(min = 1, max = 16)",
             "lognormal": "lognormal(median = 8, max = 16, sigma = 0.5)",
             "empirical": 'empirical("h.csv", max = 16)'}
    for d in keys.DISTRIBUTIONS:
        for p in d.params:
            yield d.name, p.name, _pipeline(gen_len=forms[d.name]), "p.rpeg"
    for p in keys.EVAL.params:
        entries = {"dataset": 'dataset = "data/x.jsonl"' if p.name != "split"
                   else 'dataset = "data/saved"', "every": "every = 1"}
        entries.setdefault(p.name, _entry(p))
        yield "eval", p.name, _pipeline(extra=f"eval {{ {'; '.join(entries.values())} }}"), \
            "p.rpeg"
    for p in keys.LOG.params:
        yield "log", p.name, _pipeline(extra=f"log {{ {_entry(p)} }}"), "p.rpeg"
    stage = {"generate": "rollout", "forward": "ref_lp", "score": "ref_lp", "train": "actor_step"}
    for p in keys.PLACE.params:
        value = "torch" if p.name == "engine" else None
        entry = f"{p.name} = {value}" if value else _entry(p)
        yield "place", p.name, _pipeline(extra=f"place {stage[p.applies[0]]} on gpus 0..0 "
                                               f"{{ {entry} }}"), "p.rpeg"
    for p in keys.CLUSTER.params:
        body = "" if p.required or p.name == "link" else _entry(p)
        yield "cluster", p.name, CLUSTER.replace("LINK", "").replace("CLUSTER", body), "c.rpeg"
    for p in keys.LINK.params:
        yield "link", p.name, CLUSTER.replace("LINK", "").replace("CLUSTER", ""), "c.rpeg"
    from rpeg.spec.cluster import CPU_TERMS  # a CPU's figures: with async_launch = 0
    for p in keys.profile_section().params:
        entry = "" if p.required else _entry(p)
        if p.name in CPU_TERMS:
            entry += "\n    async_launch = 0"
        yield "profile", p.name, PROFILE.replace("PROFILE", entry), "x.rpeg"


def test_every_documented_key_is_accepted(tmp_path):
    checked = set()
    for section, key, source, name in _specs(tmp_path):
        f = tmp_path / name
        f.write_text(source)
        try:
            check_file(f)
        except SpecError as e:
            raise AssertionError(f"{section}.{key} is documented and refused:\n{e.render()}\n"
                                 f"--- the spec ---\n{source}") from None
        checked.add((section, key))
    documented = {(s.name, p.name) for s in keys.SECTIONS + (keys.profile_section(),)
                  for p in s.params}
    documented |= {("workload", k) for k in keys.DATA.keys}
    documented |= {("model", k) for k in keys.ARCHITECTURE.keys}
    assert documented - {("data", k) for k in keys.DATA.keys} \
        - {("architecture", k) for k in keys.ARCHITECTURE.keys} <= checked


def _topic_of(section: keys.Section) -> str:
    for t in TOPICS:
        if any(s.name == section.name for s in t.sections):
            return t.name
    raise AssertionError(f"section {section.name} is in no topic of rpeg help")


@pytest.mark.parametrize("section", keys.SECTIONS + (keys.profile_section(),),
                         ids=lambda s: s.name)
def test_every_registry_key_is_in_rpeg_help(section):
    printed = text(_topic_of(section))
    assert section.form in printed
    for p in section.params:
        assert p.doc, f"{section.name}.{p.name} has no meaning in rpeg/spec/keys.py"
        assert re.search(rf"^      {re.escape(p.name)} ", printed, re.M), \
            f"rpeg help {_topic_of(section)} does not print {section.name}.{p.name}"


def test_every_profile_field_has_a_meaning():
    fields = {a.name for a in attrs.fields(GpuProfile) if "unit" in a.metadata} | {"source"}
    assert fields - set(keys.PROFILE_DOCS) == set(), \
        "GpuProfile fields without a line in rpeg/spec/keys.py's PROFILE_DOCS"
    assert set(keys.PROFILE_DOCS) - fields == set(), "PROFILE_DOCS lines of no field"


# --- the other way: the checker accepts no key the registry does not name ----------------------

def _source_names() -> set[str]:
    """Every lower-case name written as a string in the checker's source, the registry's keys
    and the vocabulary's names: what a key added by hand would be among."""
    names = set()
    for path in (ROOT / "rpeg" / "spec").glob("*.py"):
        for node in pyast.walk(pyast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, pyast.Constant) and isinstance(node.value, str) \
                    and node.value.isidentifier() and node.value.islower():
                names.add(node.value)
    names |= {p.name for s in keys.SECTIONS for p in s.params}
    names |= {n for f in FOREIGN for n in f.names if n.isidentifier()}
    return names - {"zzprobe"}


PROBE = "zzprobe"


def _contexts():
    """(context, the keys it documents, a parsed file with a ``zzprobe = 1`` in it, lower)."""
    def pipe(**parts):
        return parse_text(_pipeline(**parts), "p.rpeg"), lambda f: lower_pipeline(f)

    yield ("workload", keys.WORKLOAD_BLOCK.keys, *pipe(workload=f"{PROBE} = 1"))
    yield ("model", keys.MODEL_BLOCK.keys, *pipe(model=f"{PROBE} = 1"))
    yield ("lora", keys.LORA.keys, *pipe(model=f"lora = lora(rank = 8, {PROBE} = 1)"))
    for d, form in (("uniform", "uniform(min = 1, max = 16, {} = 1)"),
                    ("lognormal", "lognormal(median = 8, max = 16, {} = 1)"),
                    ("fixed", "fixed(n = 8, {} = 1)")):
        yield (d, keys.distribution(d).keys, *pipe(gen_len=form.format(PROBE)))
    yield ("eval", keys.EVAL.keys,
           *pipe(extra=f'eval {{ dataset = "x.jsonl"; every = 1; {PROBE} = 1 }}'))
    yield ("log", keys.LOG.keys, *pipe(extra=f"log {{ {PROBE} = 1 }}"))
    for kind, stage in ((OpKind.GENERATE, "rollout"), (OpKind.FORWARD, "ref_lp"),
                        (OpKind.TRAIN, "actor_step")):
        yield (f"place {kind.value}", keys.layout_keys(kind),
               *pipe(extra=f"place {stage} on gpus 0..0 {{ {PROBE} = 1 }}"))
    cluster = CLUSTER.replace("LINK", "").replace("CLUSTER", f"{PROBE} = 1")
    yield "cluster", keys.CLUSTER.keys, parse_text(cluster, "c.rpeg"), lower_cluster
    link = CLUSTER.replace("LINK", f"; {PROBE} = 1").replace("CLUSTER", "")
    yield "link", keys.LINK.keys, parse_text(link, "c.rpeg"), lower_cluster
    profile = PROFILE.replace("PROFILE", f"{PROBE} = 1")
    yield "profile", keys.profile_section().keys, parse_text(profile, "x.rpeg"), lower_profile


def _renamed(node, name: str):
    """``node`` with the probe's name changed to ``name``."""
    if isinstance(node, spec_ast.Ident) and node.value == PROBE:
        return attrs.evolve(node, value=name)
    if isinstance(node, tuple):
        return tuple(_renamed(x, name) for x in node)
    if attrs.has(type(node)):
        changes = {f.name: _renamed(getattr(node, f.name), name) for f in attrs.fields(type(node))
                   if isinstance(getattr(node, f.name), tuple)
                   or attrs.has(type(getattr(node, f.name)))}
        return attrs.evolve(node, **changes)
    return node


REFUSED = ("unknown key", "must be pinned with one of", "takes no key")


@pytest.mark.parametrize("context", list(_contexts()), ids=lambda c: c[0])
def test_the_checker_accepts_no_key_the_registry_does_not_name(context):
    where, documented, tree, lower = context
    accepted = []
    for name in sorted(_source_names() - set(documented)):
        try:
            lower(_renamed(tree, name))
        except SpecError as e:
            if any(r in e.message for r in REFUSED) and f"'{name}'" in e.message:
                continue
            accepted.append(f"{name}: {e.message}")
            continue
        accepted.append(f"{name}: accepted")
    assert not accepted, (f"the {where} block takes keys rpeg/spec/keys.py does not document "
                          "(add them to the registry, with their meaning):\n"
                          + "\n".join(accepted))


@pytest.mark.parametrize("module", ["rpeg.spec.keys", "rpeg.spec.topics",
                                    "rpeg.spec.vocabulary", "rpeg.spec.arch"])
def test_module_examples(module, monkeypatch):
    import doctest
    import importlib
    monkeypatch.chdir(ROOT)
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} example(s) failed in {module}"
