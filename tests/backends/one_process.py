"""Steps of a plan run in one process (one device, the CPU): ``run_step(pipeline, plan)``
builds one step's calls and runs each on one executor, its inputs the results of the calls
it depends on, and returns the executor."""

from __future__ import annotations


def run_step(pipeline, plan, steps: int = 1):
    from backends.torch_backend.executor import Executor
    from rpeg.runtime.lowering.context import RunContext
    from rpeg.runtime.lowering.instances import build_calls
    calls = build_calls(pipeline, plan, steps=steps)
    ex = Executor(RunContext.create(pipeline, plan, calls, run_dir=""), 0)
    results = {}
    for call in calls:
        inputs, pos = {}, 0
        for name, count in call.inputs:
            inputs[name] = [results[call.deps[pos + i]][name] for i in range(count)]
            pos += count
        results[call.id], _ = ex.run(call, inputs)
    return ex
