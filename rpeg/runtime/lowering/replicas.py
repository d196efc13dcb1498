"""Replicas and weight transfers named: which copy of a model an op call reads, and the
roles of a weight sync's calls (shared by the calls' builder and its ordering passes).

    >>> base_of("actor~tp0-1"), engine_key("actor"), is_engine_key("actor~vllm")
    ('actor', 'actor~vllm', True)
"""

from __future__ import annotations

from collections import defaultdict

import attrs

EXPORT, LOAD = "export", "load"
SEND, RECV = "send", "recv"      # weight sync into a vLLM engine's copy, through collectives
VARIANT = "~"          # "actor~tp0-1": a second copy of actor on a device, split another way
ENGINE = "vllm"        # "actor~vllm": the copy a vLLM engine serves (its own devices, or tp > 1)


def base_of(key: str | None) -> str | None:
    """The backbone a replica key names (``actor~tp0-1`` -> ``actor``)."""
    return key.split(VARIANT)[0] if key else key


def engine_key(model: str) -> str:
    """The key of the copy of ``model`` a vLLM engine serves alone (``actor~vllm``)."""
    return model + VARIANT + ENGINE


def is_engine_key(key: str | None) -> bool:
    return bool(key) and key.endswith(VARIANT + ENGINE)


def engine_hosts(calls) -> dict[str, tuple[int, ...]]:
    """Backbone -> the devices hosting a vLLM engine that serves its own copy of it."""
    out: dict[str, set[int]] = defaultdict(set)
    for c in calls:
        c = c if isinstance(c, dict) else attrs.asdict(c, recurse=False)
        if is_engine_key(c["model"]) and not c.get("role"):
            out[base_of(c["model"])].add(c["device"])
    return {k: tuple(sorted(v)) for k, v in out.items()}


def engine_blocks(plan, calls) -> dict[tuple[str, int], tuple[int, ...]]:
    """(engine copy key, host device) -> the devices its vLLM engine's workers span: the
    tensor-parallel block of its generate stage that starts at the host."""
    out = {}
    for c in calls:
        c = c if isinstance(c, dict) else attrs.asdict(c, recurse=False)
        if is_engine_key(c["model"]) and not c.get("role"):
            p = plan.placement(c["stages"][0])
            i = p.devices.index(c["device"])
            out[(c["model"], c["device"])] = tuple(p.devices[i:i + p.tp])
    return out
