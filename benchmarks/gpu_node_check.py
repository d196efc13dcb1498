"""A check on a node of several GPUs: one device per worker, sharded trainers' weight syncs,
engines beside trainers, each run verified and measured against its plan.

On a GPU node (the same set-up as ``benchmarks/gpu_check.py``: the wheels it lacks carried
in .gpu-wheels/), from the repository root:

    bash scripts/gpu-wheels.sh install
    PYTHONPATH=$PWD:$PWD/.gpu-site python3 benchmarks/gpu_node_check.py --gpus 8 --kind h100 --out "$OUT"

Here, without GPUs, ``--cpu`` runs the same checks with the tiny model on as many CPU
workers (a check of the script: ``--cpu --gpus 3`` runs in minutes).

Checks (GRPO on Qwen2.5-0.5B's shape; ``N`` = ``--gpus``):

* ``zero2-apart`` — the trainer at ZeRO-2 over GPUs 1..N-1, the rollout on GPU 0: every
  version synced from the trainer's first rank (weights whole between ops);
* ``zero3-shared`` — ZeRO-3 over all N GPUs, the rollout on GPU 0 beside it: every rank
  gathers each tensor for the sync, the copy on GPU 0 loaded in place;
* ``dp-tp`` — (N >= 5) ZeRO-3 on a dp x tp 2 mesh over GPUs 1..4, the rollout on GPU 0;
* ``vllm-apart``, ``vllm-shared`` — (vLLM installed) the same as the first two with the
  rollout on vLLM: collectives into an engine on its own GPU, CUDA IPC into one on a
  trainer's GPU (sleeping while the trainer trains).

Every run must say its ops ran on CUDA with each device on a GPU of its own
(``run.json``'s ``gpus``); writes gpu_node_check.md and .json to ``--out``. Budget: under
8 minutes on 8 H100s.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_check import Check, arguments, run_all  # noqa: E402


def node_checks(n: int) -> tuple[Check, ...]:
    """The checks a node of ``n`` GPUs (or CPU workers) can run."""
    last = n - 1
    zero2 = f"place actor_step on gpus 1..{last} {{ dp = {last}; zero = 2 }}"
    zero3 = f"place actor_step on gpus 0..{last} {{ dp = {n}; zero = 3 }}"
    apart = ("place rollout on gpus 0..0 { tp = 1 }", "place ref_lp on gpus 0..0")
    checks = [Check("zero2-apart", (zero2, *apart)) if n > 2 else None,
              Check("zero3-shared", (zero3, *apart))]
    if n >= 5:
        checks.append(Check("dp-tp", ("place actor_step on gpus 1..4 { dp = 2; tp = 2; "
                                      "zero = 3 }", *apart)))
    if n > 2:
        checks.append(Check("vllm-apart", (zero2, *apart), engine="vllm", needs="vllm"))
    checks.append(Check("vllm-shared", (zero3, *apart), engine="vllm", needs="vllm"))
    return tuple(c for c in checks if c is not None)


def main(argv=None) -> int:
    args = arguments(__doc__, argv, gpus=True)
    if args.gpus < 2:
        print("gpu_node_check: --gpus must be at least 2 (one GPU: benchmarks/gpu_check.py)",
              file=sys.stderr)
        return 2
    return run_all(node_checks(args.gpus), args, "gpu_node_check", gpus=args.gpus,
                   kind=args.kind, title=f"GPU node check ({args.gpus} GPUs)")


if __name__ == "__main__":
    sys.exit(main())
