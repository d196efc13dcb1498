"""Writes ``keys.jsonl``: the tool task's prompts, keys whose values only a tool knows.

    $ python pipelines/data/make_keys.py          # deterministic: same file every time

Each prompt opens a call of the lookup tool on a key of three lowercase letters,
``"<k>kqz"`` (as a system prompt shows a tool's use); its answer is the value the tool
(``pipelines/tools.py``, ``tools:lookup``) holds for the key: a letter a to h drawn from a
seeded hash of the key with a salt the policy never sees. The keys are 2,000 of the 17,576
possible, drawn at random. The policy must end the call (at once, or with ``</k>``) to get
the value, then answer with it; a policy that ignores the tool's result can only guess.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

KEYS = 2000
SEED = 7
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def rows() -> list[dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tools import lookup
    rng = random.Random(SEED)
    keys: list[str] = []
    seen: set[str] = set()
    while len(keys) < KEYS:
        k = "".join(rng.choice(LETTERS) for _ in range(3))
        if k not in seen:
            seen.add(k)
            keys.append(k)
    return [{"prompt": f"<k>{k}", "answer": lookup(k)} for k in keys]


if __name__ == "__main__":
    out = Path(__file__).with_name("keys.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    print(f"wrote {out} ({KEYS} keys)")
