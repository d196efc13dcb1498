"""Published step times kept apart from the fit: rpeg's GPU cost model on rows it never saw.

    .venv/bin/python benchmarks/published_apart.py

The calibration rows (:mod:`benchmarks.published_rows`, ``ROWS``) set the shared engine
terms (``benchmarks/published_fit.py``); the rows here are never given to that fit: other
modes and models of a source, written the same way (``benchmarks/published/apart/``, each
file citing its table row and recipe and stating what it assumes), priced with the shipped
terms as they ran (``--strategy pinned``). A row rpeg refuses ("no plan fits") is a
configuration that really ran, so it counts as a miss (``false_no_fit``) and is not within
any ratio. Writes benchmarks/results/published_apart.json and .md.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import finish, header, provenance  # noqa: E402
from benchmarks.published_rows import Row, aggregates, log2_error, price  # noqa: E402

SOURCE = "nemo-rl-v0.4 (kept apart)"
# NeMo RL v0.4's performance table (NVIDIA-NeMo/RL docs/about/performance-summary.md
# @06beed91): the calibration set holds its four on-policy rows of dense models and
# DeepSeek-V3 (NEMO-B1..B4); these are its other six: the 1-step off-policy rows and the
# Qwen3-30B-A3B ones
OFF = "NeMo RL, 1-step off-policy"


def _row(rid: str, system: str, spec: str, gpus: int, seconds: float) -> Row:
    return Row(rid, SOURCE, system, f"apart/{spec}.rpeg", f"dgx_h100_{gpus}.rpeg",
               (("step", seconds),))


APART = (
    _row("NEMO-A1", OFF, "nemo_a1_llama3_8b_1off", 16, 74.6),
    _row("NEMO-A2", "NeMo RL", "nemo_a2_qwen3_30b_a3b", 32, 225.0),
    _row("NEMO-A3", OFF, "nemo_a3_qwen3_30b_a3b_1off", 32, 244.0),
    _row("NEMO-A4", OFF, "nemo_a4_qwen3_32b_1off", 64, 215.0),
    _row("NEMO-A5", OFF, "nemo_a5_qwen3_235b_1off", 256, 241.0),
    _row("NEMO-A6", OFF, "nemo_a6_deepseek_v3_1off", 512, 77.9),
)
RESULTS = ROOT / "benchmarks" / "results"


def main() -> None:
    prov = provenance()
    results = []
    for row in APART:
        began = time.perf_counter()
        r = price(row)
        results.append(r)
        what = f"{r.predicted[row.main]:.1f} s ({r.ratio:.2f}x)" if r.status == "ok" \
            else f"{r.status}: {r.message}"
        print(f"{row.id:<10} published {row.figure:.1f} s -> {what} "
              f"({time.perf_counter() - began:.1f} s)", flush=True)
    agg = aggregates(results)
    finish(prov)
    print(json.dumps(agg, indent=2))
    rows = [{"id": r.row.id, "system": r.row.system, "spec": r.row.spec,
             "cluster": r.row.cluster, "published": r.row.figure, "status": r.status,
             "predicted": r.predicted.get(r.row.main), "ratio": r.ratio,
             "message": r.message} for r in results]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "published_apart.json").write_text(json.dumps(
        {"provenance": prov, "aggregates": agg, "rows": rows}, indent=2) + "\n")
    lines = ["# Published step times kept apart from the fit", "", header(prov), "",
             "Rows the shared engine terms were never fitted on (`benchmarks/published/apart/`), "
             "priced with the shipped terms as they ran. Ratio = predicted / published; a "
             "configuration rpeg refuses is a false 'no plan fits'.", "",
             f"- rows: {agg['rows']}, priced: {agg['priced']}, false 'no plan fits': "
             f"{agg['false_no_fit']}",
             f"- median |log2 ratio| of the priced rows: {agg['median_abs_log2']:.2f}; within "
             f"1.25x / 1.5x / 2x: {agg['within']['1.25x']:.0%} / {agg['within']['1.5x']:.0%}"
             f" / {agg['within']['2x']:.0%} of the rows; Spearman {agg['spearman']:.2f}", "",
             "| row | system | GPUs' cluster | published s | predicted s | ratio | |log2| |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in results:
        if r.status == "ok":
            lines.append(f"| {r.row.id} | {r.row.system} | {r.row.cluster} | "
                         f"{r.row.figure:.1f} | {r.predicted[r.row.main]:.1f} | "
                         f"{r.ratio:.2f}x | {log2_error(r):.2f} |")
        else:
            lines.append(f"| {r.row.id} | {r.row.system} | {r.row.cluster} | "
                         f"{r.row.figure:.1f} | {r.status}: {r.message[:160]} | - | - |")
    (RESULTS / "published_apart.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
