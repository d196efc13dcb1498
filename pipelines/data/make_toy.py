"""Writes ``toy.jsonl``: the toy task the tiny pipelines learn from scratch.

    $ python pipelines/data/make_toy.py          # deterministic: same file every time

Each prompt names a letter and a count, ``"b*5="``; the answer is the letter
repeated that many times, ``"bbbbb"``. Counts run from 1 to 16, so answers
(and, once learnt, generations) have a real length tail. The reward
(``rewards:toy_reward``) gives partial credit per correct letter and for
stopping at the right length, so a randomly initialised byte-level model has
a gradient to climb.
"""

from __future__ import annotations

import json
from pathlib import Path

LETTERS = "abc"
MAX_COUNT = 16


def rows() -> list[dict]:
    return [{"prompt": f"{ch}*{n}=", "answer": ch * n}
            for ch in LETTERS for n in range(1, MAX_COUNT + 1)]


if __name__ == "__main__":
    out = Path(__file__).with_name("toy.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    print(f"wrote {out} ({len(rows())} prompts)")
