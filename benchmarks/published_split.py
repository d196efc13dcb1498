"""Where ReaL's weak-scaling bars spend their time: generation per decode step, and the rest.

    .venv/bin/python benchmarks/published_split.py       # price the pinned bars, write the split

ReaL's figure runs every system at three answer lengths (128, 384, 896 tokens) with the same
2^17 tokens a step (:data:`benchmarks.published_rows.REAL_STEPS`). Over the three, the work
that does not depend on the answer length (the experience forwards and the training over the
step's tokens, and whatever a step pays once) is about constant, while generation takes one
decode step per answer token. A line through each system's three step times, ``step =
fixed + per_token * gen_len``, splits them: its slope is the cost of one decode step (of the
whole batch), its intercept the rest. The same line through rpeg's predictions for the same
rows says which of the two the model prices differently from what ran.

Writes benchmarks/results/published_split.json and .md. The bars priced as they ran (DeepSpeed-
Chat's and OpenRLHF's as ReaL's authors ran them, ReaL-Heuristic) are priced here; ReaL's own
bars, which need a search, are read from benchmarks/results/published.json (the predictions the
last ``benchmarks/published.py`` recorded), and say so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import finish, header, provenance, save  # noqa: E402
from benchmarks.published_rows import REAL_STEPS, REAL_SYSTEMS, ROWS, price  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
LENGTHS = tuple(sorted(REAL_STEPS))


def line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points."""
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(slope), float(intercept)


def split(recorded: dict) -> list[dict]:
    """Per system and GPU count: the published and the predicted line."""
    out = []
    gpus = sorted(REAL_STEPS[LENGTHS[0]])
    for k, (name, system) in enumerate(REAL_SYSTEMS):
        for n in gpus:
            pub, pred, lens, how = [], [], [], "priced"
            for gen in LENGTHS:
                step = REAL_STEPS[gen][n][k]
                if step is None:
                    continue
                rid = f"REAL-{name}-{n}-g{gen}"
                if name == "real":
                    got = recorded.get(rid)
                    how = "recorded"
                else:
                    r = price(ROWS[rid])
                    got = r.predicted.get("step") if r.status == "ok" else None
                if got is None:
                    continue
                lens.append(gen)
                pub.append(step)
                pred.append(got)
            if len(lens) < 2:
                continue
            ps, pi = line(lens, pub)
            qs, qi = line(lens, pred)
            out.append({"system": system, "gpus": n, "lengths": lens, "published": pub,
                        "predicted": pred, "how": how,
                        "published_per_token_s": ps, "published_fixed_s": pi,
                        "predicted_per_token_s": qs, "predicted_fixed_s": qi})
    return out


def markdown(rows: list[dict], prov: dict) -> str:
    lines = ["# ReaL's weak-scaling bars split: generation per decode step, and the rest", "",
             header(prov), "",
             "Each system's step times at answers of 128, 384 and 896 tokens (the same 2^17 "
             "tokens a step) on a line `step = fixed + per_token * gen_len`: the slope is one "
             "decode step of the batch, the intercept the work that does not depend on the "
             "answer length (experience forwards, training, per-step costs). Published: "
             "ReaL's figure (`benchmarks/published_rows.py`); predicted: rpeg's pricing of the "
             "same rows (ReaL's own bars: as `benchmarks/results/published.json` recorded "
             "them).", "",
             "| system | GPUs | per decode step, published ms | predicted ms | ratio | "
             "fixed, published s | predicted s | ratio |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pt, qt = r["published_per_token_s"], r["predicted_per_token_s"]
        pf, qf = r["published_fixed_s"], r["predicted_fixed_s"]
        how = " (recorded)" if r["how"] == "recorded" else ""
        lines.append(f"| {r['system']}{how} | {r['gpus']} | {1e3 * pt:.1f} | {1e3 * qt:.1f} | "
                     f"{qt / pt:.2f} | {pf:.1f} | {qf:.1f} | {qf / pf:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    prov = provenance()
    path = RESULTS / "published.json"
    recorded = {}
    if path.exists():
        recorded = {r["id"]: r["predicted"].get("step")
                    for r in json.loads(path.read_text())["rows"] if r["status"] == "ok"}
    rows = split(recorded)
    finish(prov)
    for r in rows:
        print(f"{r['system']:<30} {r['gpus']:>3}  per step {1e3 * r['published_per_token_s']:6.1f}"
              f" -> {1e3 * r['predicted_per_token_s']:6.1f} ms   fixed "
              f"{r['published_fixed_s']:6.1f} -> {r['predicted_fixed_s']:6.1f} s")
    save("published_split", {"provenance": prov, "rows": rows}, markdown(rows, prov))


if __name__ == "__main__":
    main()
