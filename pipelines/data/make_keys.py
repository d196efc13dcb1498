"""Writes ``keys.jsonl``: the tool task's prompts, keys whose values only a tool knows.

    $ python pipelines/data/make_keys.py          # deterministic: same file every time

Each prompt is a key of three letters from a to h, ``"hbe"``; its answer is the value the
lookup tool (``pipelines/tools.py``, ``tools:lookup``) holds for it, three letters a to z
drawn from a seeded hash of the key with a salt the policy never sees. The keys are 400 of
the 512 possible, drawn at random: a policy that does not call the tool can only guess.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

KEYS = 400
ALPHABET = "abcdefgh"       # keys over 8 letters (512 possible); values over all 26
SEED = 7


def rows() -> list[dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tools import lookup
    rng = random.Random(SEED)
    keys: list[str] = []
    seen: set[str] = set()
    while len(keys) < KEYS:
        k = "".join(rng.choice(ALPHABET) for _ in range(3))
        if k not in seen:
            seen.add(k)
            keys.append(k)
    return [{"prompt": k, "answer": lookup(k)} for k in keys]


if __name__ == "__main__":
    out = Path(__file__).with_name("keys.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    print(f"wrote {out} ({KEYS} keys)")
