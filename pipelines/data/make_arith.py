"""Arithmetic word problems with their answers: the real task's data, made here, seeded.

    $ python pipelines/data/make_arith.py            # writes arith_train.jsonl, arith_test.jsonl

Each row is ``{"question": ..., "answer": "<integer>", "op": "+|-|x"}``: one addition,
subtraction or multiplication told as a short story, small numbers. The two files share
no question. ``rewards:exact_match`` is their verifier (the last number of a response must
equal the answer). The files in this folder are this script's output with its defaults.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ("Sam", "Ana", "Leo", "Mia", "Tom", "Ivy", "Raj", "Zoe", "Ben", "Eva")
THINGS = ("apples", "marbles", "books", "pens", "stickers", "cards", "shells", "coins")
PLACES = ("box", "bag", "jar", "basket", "shelf")


def problem(rng: random.Random) -> dict:
    name, thing, place = rng.choice(NAMES), rng.choice(THINGS), rng.choice(PLACES)
    op = rng.choice("+-x")
    if op == "+":
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        q = f"{name} has {a} {thing}. {name} gets {b} more {thing}. How many {thing} does " \
            f"{name} have now?"
        ans = a + b
    elif op == "-":
        a = rng.randint(10, 40)
        b = rng.randint(1, a - 1)
        q = f"A {place} holds {a} {thing}. {name} takes {b} {thing} out of the {place}. " \
            f"How many {thing} are left in the {place}?"
        ans = a - b
    else:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        q = f"{name} has {a} {place}s with {b} {thing} in each {place}. How many {thing} " \
            f"does {name} have in all?"
        ans = a * b
    return {"question": q + " Answer with the number.", "answer": str(ans), "op": op}


def make(train: int, test: int, seed: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < train + test:
        r = problem(rng)
        if r["question"] not in seen:
            seen.add(r["question"])
            rows.append(r)
    return rows[:train], rows[train:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--test", type=int, default=200)
    ap.add_argument("--seed", type=int, default=19)
    ap.add_argument("-o", "--out", type=Path, default=Path(__file__).parent)
    args = ap.parse_args()
    train, test = make(args.train, args.test, args.seed)
    for name, rows in (("arith_train.jsonl", train), ("arith_test.jsonl", test)):
        (args.out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
