"""The text of benchmarks/results/reliability.md, every sentence computed from the figures
of benchmarks/results/reliability.json (``benchmarks/reliability.py`` writes both).

    >>> print(markdown(json.loads(Path("benchmarks/results/reliability.json").read_text())))  # doctest: +SKIP
    ## Reliability
    ...
"""

from __future__ import annotations

import json  # noqa: F401 (doctest)
from pathlib import Path  # noqa: F401 (doctest)

PARTS = ("hostile", "nothing_lost", "bounds", "faults", "fuzz", "overhead")


def markdown(result: dict) -> str:
    lines = ["## Reliability", "", "Each part was measured by the command named, from the "
             "repository's root:", ""]
    for part in PARTS:
        p = result.get("provenance", {}).get(part)
        if p is None or part == "fuzz":           # fuzz.py measured it; its command is below
            continue
        m, load = p["machine"], p["load_average"]
        end = f" to {load['end']}" if "end" in load else ""
        lines.append(f"- {part}: `{p['command']}` ({p['date']}; {m['cpu']}, {m['cores']} "
                     f"cores, python {m['python']}; load average {load['start']}{end})")
    lines.append("")
    lines += _hostile(result.get("hostile"))
    lines += _nothing_lost(result.get("nothing_lost"))
    lines += _bounds(result.get("bounds"))
    lines += _faults(result.get("faults"))
    lines += _fuzz(result.get("fuzz"))
    lines += _overhead(result.get("overhead"), result.get("faults"))
    return "\n".join(lines) + "\n" + SECURITY


def _hostile(h: dict | None) -> list[str]:
    if not h:
        return []
    kinds = h["by_kind"]
    text = (f"**Hostile files:** {h['tried']} attempts ({kinds['plan']} with hand-edited plans "
            f"through `simulate`, `run`, `diff` and `show`; {kinds['run directory']} with "
            f"damaged run directories through `verify`, `show` and `run --resume`; "
            f"{kinds['spec']} with specs through `check`): {h['refused']} refused with exit 1 "
            f"and a message naming the file and the field, {h['hang']} hangs (an attempt still "
            f"running after 120 s), {h['internal']} internal errors, {h['accepted']} accepted, "
            f"{h['other']} refused otherwise. Files outside the run directory changed in "
            f"{h['outside_touched']} attempts; the slowest attempt took {h['slowest_s']} s.")
    lines = [text, ""]
    odd = [c for c in h["cases"] if c["outcome"] != "refused" or c["outside_touched"]]
    if odd:
        lines += ["| kind | case | command | outcome | message |", "|---|---|---|---|---|"]
        lines += [f"| {c['kind']} | {c['case']} | {c['argv']} | {c['outcome']} | "
                  f"{c['message'][:120]} |" for c in odd]
        lines.append("")
    return lines


def _nothing_lost(n: dict | None) -> list[str]:
    if not n:
        return []
    kinds = n["by_kind"]
    lines = [f"**Nothing lost:** {n['tried']} attempts ({kinds['output']} writing an output "
             f"over or into a run directory, onto a file, over a folder rpeg did not write "
             f"or around what the command reads; "
             f"{kinds['tensor']} exporting or resuming checkpoints whose tensors are damaged "
             f"behind a matching manifest; {kinds['start']} starts that cannot reach their "
             f"scheduler or name an unknown tracker): {n['refused']} refused with exit 1 and "
             f"a message naming the file, {n['hang']} hangs, {n['internal']} internal errors, "
             f"{n['accepted']} accepted, {n['other']} refused otherwise. Files that must not "
             f"change changed in {n['touched']} attempts; {n['leftovers']} temporary files "
             f"were left; {n['run_dir_written']} refused starts wrote their run directory.", ""]
    for r in n["resumed"]:
        ok = all(r[k] for k in ("steps_once_each", "earlier_rows_kept", "later_rows_set_aside",
                                "damaged_checkpoint_kept", "verify_ok"))
        lines.append(f"A resume after the latest checkpoint was damaged ({r['damage']}) "
                     + ("went on from the one before it: every step once in the metrics, the "
                        "rows before it kept, those after it moved to a file of their own, "
                        "the damaged checkpoint kept under its own name, and the run "
                        "verified." if ok else f"did not keep everything: {r}"))
    t = n["retried"]
    lines.append(f"A start whose workers' set-up failed left its run directory marked "
                 f"`{t['status_after_failure']}`; the same command then "
                 + ("ran into it and the run verified." if t["second_rc"] == 0
                    and t["verify_ok"] else f"did not run (exit {t['second_rc']})."))
    odd = [c for c in n["cases"] if c["outcome"] != "refused" or c["touched"]
           or c["leftovers"]]
    if odd:
        lines += ["", "| kind | case | command | outcome | message |", "|---|---|---|---|---|"]
        lines += [f"| {c['kind']} | {c['case']} | {c['argv']} | {c['outcome']} | "
                  f"{c['message'][:120]} |" for c in odd]
    return lines + [""]


def _bounds(b: dict | None) -> list[str]:
    if not b:
        return []
    s, v = b["simulate_steps"], b["verify"]
    lines = ["**Bounds:** `rpeg simulate --steps 100000000` "
             + (f"is a usage error (exit {s['rc']}) in {s['s']} s" if s["rc"] == 2 else
                f"ended with exit {s['rc']} after {s['s']} s")
             + f"; `rpeg verify` of a run whose trace lost every op prints "
             f"{v['lines_printed']} lines for its {v['violations']} violations (a summary, the "
             f"first {v['lines_printed'] - 2}, a count), where it printed "
             f"{v['lines_before']} before (one line each).", ""]
    rows = {r["stages"]: r for r in b["check"]}
    before = {r["stages"]: r for r in b.get("check_before", [])}
    lines += ["| stages | bytes | check wall s | CPU s | lines | load |"
              + (" before: wall s | CPU s | lines |" if before else ""),
              "|---|---|---|---|---|---|" + ("---|---|---|" if before else "")]
    for n, r in sorted(rows.items()):
        cells = f"| {n:,} | {r['bytes']:,} | {r['wall_s']} | {r['cpu_s']} | {r['lines']} | " \
                f"{r['load']} |"
        if before:
            o = before.get(n, {})
            cells += (f" {o.get('wall_s')} | {o.get('cpu_s')} | {o.get('lines')} |"
                      if o.get("rc") is not None else f" > {o.get('wall_s')} (stopped) | | |")
        lines.append(cells)
    big = rows[max(rows)]
    ns = sorted(rows)
    per = [(a, b, 1e3 * (rows[b]["cpu_s"] - rows[a]["cpu_s"]) / (b - a))
           for a, b in zip(ns, ns[1:], strict=False)]
    lines += ["", f"`rpeg check` of {big['stages']:,} stages ({big['bytes'] / 1e6:.1f} MB) took "
              f"{big['wall_s']} s ({big['cpu_s']} s of CPU, load {big['load']}). Each stage "
              "added cost " + ", ".join(f"{ms:.3f} ms of CPU from {a:,} to {b:,} stages"
                                        for a, b, ms in per)
              + _linear([ms for _, _, ms in per]) + "."]
    commit = f" (commit {b['before_commit']})" if b.get("before_commit") else ""
    if before and before.get(big["stages"], {}).get("rc") is None:
        lines[-1] += (f" With the code before{commit}, it was still running after "
                      f"{before[big['stages']]['wall_s']} s.")
    elif before:
        o = before[big["stages"]]
        lines[-1] += (f" With the code before{commit}: {o['wall_s']} s ({o['cpu_s']} s of "
                      "CPU).")
    return lines + [""]


def _linear(costs: list[float]) -> str:
    """What the cost per stage at each size says of the check's growth."""
    if len(costs) < 2 or min(costs) <= 0:
        return ""
    spread = max(costs) / min(costs)
    if spread <= 1.5:
        return (f": within a factor of {spread:.2f} at every size, so time grows linearly with "
                "the spec (the rest is the command's start)")
    return f": it grew by a factor of {spread:.2f} with the spec's size (not linear)"


def _faults(faults: list[dict] | None) -> list[str]:
    if not faults:
        return []
    inj = sum(r["injected"] for r in faults)
    ok = sum(r["injected"] for r in faults if r["survived"])
    lines = [f"**Faults:** {inj} injected, {ok} survived with nothing lost (every step once in "
             "the metrics, every value equal to the uninterrupted in-process reference, "
             "exactly, on CPU).", "",
             "| scenario | injected | recoveries | resumes | steps once each | "
             "metrics = reference | rpeg verify | wall s |", "|---|---|---|---|---|---|---|---|"]
    for r in faults:
        lines.append(f"| {r['scenario']} | {r['injected']} | {r['recoveries']} | "
                     f"{r['resumes']} | {r['steps_once_each']} | "
                     f"{r['metrics_equal_reference']} | {r['verify_ok']} | {r['wall_s']} |")
    failed = [r for r in faults if r.get("error")]
    if failed:
        lines += [""] + [f"The run of \"{r['scenario']}\" ended with an error: {r['error']}"
                         for r in failed]
    return lines + [""]


def _fuzz(fz: dict | None) -> list[str]:
    if not fz:
        return []
    return [f"**Fuzzing:** {fz['inputs_tried']:,} inputs (half coverage-guided with atheris, "
            "half structure-aware mutations: pipelines, clusters, profiles through the parser "
            f"and checker, and plan.json), {fz['crashes_found']} crashes or hangs; "
            f"`{fz['command']}`.", ""]


def _op_median(faults: list[dict] | None) -> float | None:
    med = sorted(r["op_ms_median"] for r in faults or () if r.get("op_ms_median"))
    return med[len(med) // 2] if med else None


def _overhead(oh: list[dict] | None, faults: list[dict] | None) -> list[str]:
    if not oh:
        return []
    lines = ["**Scheduling overhead** (scheduling core + Dask, null ops, 2 worker processes):",
             "", "| chunks | ops per step | core only ms/op | core + Dask ms/op | ops/s |",
             "|---|---|---|---|---|"]
    for r in oh:
        lines.append(f"| {r['chunks']} | {r['ops_per_step']} | {r['core_only_ms_per_op']} | "
                     f"{r['dask_ms_per_op']} | {r['dask_ops_per_s']} |")
    big = max(oh, key=lambda r: r["ops_per_step"])
    small = min(oh, key=lambda r: r["ops_per_step"])
    per_op = [r["dask_ms_per_op"] for r in oh]
    spread = max(per_op) / min(per_op)
    shape = (f"stays within a factor of {spread:.2f} ({min(per_op)}–{max(per_op)} ms)"
             if spread <= 1.5 else
             f"varies by a factor of {spread:.2f} ({min(per_op)}–{max(per_op)} ms)")
    worst = max(per_op)
    text = (f"At {big['ops_per_step']:,} ops per step, scheduling alone costs "
            f"{big['ops_per_step'] * big['dask_ms_per_op'] / 1e3:.1f} s per step "
            f"({big['dask_ms_per_op']} ms per op, of which the scheduling core is "
            f"{big['core_only_ms_per_op']} ms). From {small['ops_per_step']:,} to "
            f"{big['ops_per_step']:,} ops per step the cost per op {shape}. An op of "
            f"{10 * worst:.0f} ms (10x the worst per-op cost) keeps scheduling under 10% of "
            "the step.")
    med = _op_median(faults)
    if med is not None:
        text += (f" The real ops of the fault runs above take {med} ms (median, from their "
                 "traces), " + ("so at this op size scheduling costs more than the ops: chunk "
                                "coarsely." if med < worst else
                                "more than the scheduling cost per op."))
    return lines + ["", text, ""]


SECURITY = """## Security

- **What runs code.** A spec runs no code of its own except the rewards it names as
  `python("module:function")`. `rpeg check` and `rpeg compile` find the module (next to
  the file that names it, then on the Python path) and the function in it by reading its
  source, without importing or running it, and report a missing one at the line of the spec.
  `rpeg run` imports and calls those functions inside the workers: a spec with such a
  reference runs that code, with the permissions of the workers. Review a spec's
  `python(...)` references as you would review the module itself.
- **Nothing read from disk is unpickled.** Plans, traces, run records and the pipeline
  in a run directory are JSON; checkpoints are safetensors plus JSON (carried data may
  name only rpeg's own value types); a test searches `rpeg/` and `backends/` for pickle,
  `torch.load` without `weights_only=True`, `eval` and `exec`. Hostile files (huge, binary,
  truncated, a pipe, a device, a symlink in a run directory) are refused with a message
  naming the file; nothing is written through a symlink out of a run directory.
- **What listens where.** The embedded cluster (no `--scheduler`) binds its scheduler,
  workers and nannies to 127.0.0.1 only; nothing on another machine can reach it.
- **TLS.** A remote scheduler is reached over `tls://` with mutual authentication:
  `rpeg run --scheduler tls://HOST:8786 --tls-ca ca.pem --tls-cert me.pem --tls-key me.key`
  (or `RPEG_TLS_CA`, `RPEG_TLS_CERT`, `RPEG_TLS_KEY`, or Dask's `distributed.comm.tls.*`
  configuration). Encryption is then required; the key file must be readable by its owner
  only. Start the scheduler and workers with the same CA (`dask scheduler --tls-ca-file ...
  --tls-cert ... --tls-key ...`); it refuses clients without a certificate the CA signed
  (tested with certificates made in the test: no certificate, a certificate from another
  CA, and plain TCP are all refused).
"""
