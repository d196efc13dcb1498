"""Writes ``arith_tools_train.jsonl`` and ``arith_tools_test.jsonl``: the arithmetic word
problems (``arith_train.jsonl``, ``arith_test.jsonl``) as chat messages whose system message
offers a calculator, for ``pipelines/smollm2_tools.rpeg``.

    $ python pipelines/data/make_arith_tools.py     # deterministic: same files every time

The calculator is called as the ChatML tool calls of SmolLM2 and Qwen write them (the
``hermes`` format); its result comes back in a ``<tool_response>``.
"""

from __future__ import annotations

import json
from pathlib import Path

SYSTEM = ("You are a helpful assistant with a calculator. To compute, write "
          '<tool_call>{"name": "calc", "arguments": {"expression": "12*7"}}</tool_call> and '
          "the result comes back. Then answer with the number.")


def convert(src: Path, dst: Path) -> int:
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    dst.write_text("".join(json.dumps({
        "prompt": [{"role": "system", "content": SYSTEM},
                   {"role": "user", "content": r["question"]}],
        "answer": r["answer"], "op": r["op"]}) + "\n" for r in rows))
    return len(rows)


if __name__ == "__main__":
    here = Path(__file__).parent
    for part in ("train", "test"):
        n = convert(here / f"arith_{part}.jsonl", here / f"arith_tools_{part}.jsonl")
        print(f"wrote arith_tools_{part}.jsonl ({n} problems)")
