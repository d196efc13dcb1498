"""The same op calls, one after another in this process: no Dask, no workers.

    >>> rows = run_inline(pipeline, plan, steps=4)   # doctest: +SKIP
    >>> rows[-1]["reward"]                                                  # doctest: +SKIP
    0.37

The reference a distributed run is measured against (runtime overhead), and a
quick way to try a pipeline's learning without a cluster. All devices' model
replicas live in this one process, so weight sync still copies real buckets.
"""

from __future__ import annotations

import time

from rpeg.graph.order import topological
from rpeg.runtime.core.scheduler import submission_order
from rpeg.runtime.dask.worker import executor_class
from rpeg.runtime.lowering.context import RunContext
from rpeg.runtime.lowering.instances import build_calls
from rpeg.runtime.rundir.directory import step_metrics


def run_inline(pipeline, plan, steps: int, on_step=None) -> list[dict]:
    calls = build_calls(pipeline, plan, steps)
    table = {c.id: c for c in calls}
    ctx = RunContext.create(pipeline, plan, calls, run_dir="")
    if ctx.replicas_collective or ctx.syncs:
        from rpeg.errors import RuntimeFailure
        what = "train data-parallel" if ctx.replicas_collective else \
            "sync weights into a vLLM engine's own copy"
        raise RuntimeFailure(f"an in-process run must not {what}: collectives need "
                             "one process per device", hint="run it on Dask (rpeg run)")
    executor = executor_class(ctx.backend)
    executors = {d: executor(ctx, d) for d in range(plan.num_devices)}
    for ex in executors.values():      # a weight transfer reads its source device's replica
        ex.peers = executors
    results: dict[str, dict] = {}
    events: dict[int, list[dict]] = {}
    rows = []
    # one step at a time: dependencies first, then the earlier step, then submission order
    submitted = {op_id: n for n, op_id in enumerate(submission_order(calls))}
    last = time.time()
    for op_id in topological(list(table), lambda i: table[i].all_deps,
                             key=lambda i: (table[i].step, submitted[i])):
        call = table[op_id]
        inputs, pos = {}, 0
        for name, count in call.inputs:
            inputs[name] = [results[call.deps[pos + i]][name] for i in range(count)]
            pos += count
        start = time.time()
        out, info = executors[call.device].run(call, inputs)
        results[op_id] = out
        events.setdefault(call.step, []).append(
            {"kind": call.kind.value, "op": call.op, "rank": call.rank, "start": start,
             "end": time.time(), "version_read": info.get("version_read", -1),
             "stats": info.get("stats", {})})
        if _step_complete(call, table, results):
            now = time.time()
            row = step_metrics(call.step, events.pop(call.step), now - last)
            last = now
            rows.append(row)
            if on_step:
                on_step(row)
    return rows


def _step_complete(call, table, results) -> bool:
    return all(c.id in results for c in table.values() if c.step == call.step)
