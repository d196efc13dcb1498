"""The runtime's lowering makes the same op calls, in the same order, as the digest of
``benchmarks/lowering_calls.py``'s text records (tiny pipelines under plans of every shape
from step 0 and a resumed step, ppo_llama8b on 8 GPUs with vLLM engines). A change that
means to change what runs updates the digest: print the text before and after and diff it.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIGEST = "f35a6b29557b5ec6bdea2e7e035ed3d0692aa200dbeb7b5a5818f5eac263a638"


def test_the_lowerings_calls_are_the_golden_ones():
    spec = importlib.util.spec_from_file_location("lowering_calls",
                                                  ROOT / "benchmarks" / "lowering_calls.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = module.dump()
    assert text.count("\n") > 5000                  # every case laid out
    assert hashlib.sha256(text.encode()).hexdigest() == DIGEST, \
        "the calls changed: diff `python benchmarks/lowering_calls.py` against main's"
