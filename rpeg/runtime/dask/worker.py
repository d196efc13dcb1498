"""What runs inside a Dask worker: set-up once, then one function per op call.

    >>> client.submit(setup, ctx, device=0, workers=[addr])               # doctest: +SKIP
    >>> client.submit(run_op, call, *dep_futures, workers=[addr])         # doctest: +SKIP
    >>> client.run(drain)                                                  # doctest: +SKIP
    {'tcp://127.0.0.1:40123': [{'id': 'rollout/s0/c0', 'start': ..., ...}]}

The backend (``backends.<name>_backend``) is imported here, inside the worker,
never in the client: this module imports no torch. Each call is timed and
recorded in a worker-local list of trace events that the client drains after
every step; the events carry what the worker itself observed (its address, the
parameter version its replica held), which is what ``rpeg verify`` checks.
"""

from __future__ import annotations

import sys
import threading
import time

from rpeg.runtime.lowering.joins import JOIN, Joined, expand

_STATE: dict[str, object] = {}
_EVENTS: list[dict] = []
_LOCK = threading.Lock()

def executor_class(name: str):
    """The op runner of backend ``name`` (``backends.load``: the runtime's only way in)."""
    import backends
    return backends.load(name, "executor")


def current_executor():
    """This worker's executor (None before ``setup``): what a function run on every worker
    (``client.run``) asks of it."""
    return _STATE.get("executor")


def current_device() -> int:
    """The device this worker runs (set by ``setup``)."""
    return _STATE["device"]


def install(executor, device: int, address: str) -> None:
    """Make ``executor`` this worker's, running ``device`` at ``address`` (what ``setup``
    does once the executor is built; a stand-in worker, ``rpeg.runtime.calibrate.fleet``,
    installs its own)."""
    _STATE.update(executor=executor, device=device, address=address)


def device_report() -> dict:
    """What this worker offers as a device: its host, the GPUs it sees (node-level ids; none
    where torch has no CUDA) and whether it may start child processes
    (``rpeg.runtime.dask.devices``)."""
    import multiprocessing

    import backends
    return {**backends.load("torch", "device_report")(),
            "daemon": bool(multiprocessing.current_process().daemon)}


def free_port() -> int:
    """A port free on this worker's host now: where a collective world whose first rank
    runs here meets (picked here, not on the client's machine, where it may be free while
    taken on this host)."""
    import socket
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def setup(ctx, device: int) -> dict:
    """Create this worker's model replicas (and join the collective world); idempotent per run."""
    if ctx.needs_collectives:
        import backends
        backends.load(ctx.backend, "init_world")(
            device, ctx.num_devices, ctx.dist_addr, list(ctx.groups),
            ctx.gpus[device].index if ctx.use_cuda else None, ctx.collective_timeout_s)
    start = time.time()
    install(executor_class(ctx.backend)(ctx, device), device, _address())
    with _LOCK:
        _EVENTS.clear()
    return {"device": device, "address": _STATE["address"], "setup_s": time.time() - start}


def run_op(call, *args):
    """Run one op call; ``args`` are the results of ``call.deps`` then ``call.after`` (a
    join's result stands for the results it joined: ``rpeg.runtime.lowering.joins``)."""
    ex = _STATE["executor"]
    args = expand(args)
    inputs: dict[str, list] = {}
    pos = 0
    for name, count in call.inputs:
        inputs[name] = [args[pos + i][name] for i in range(count)]
        pos += count
    start, cpu = time.time(), time.thread_time()
    outputs, info = ex.run(call, inputs)
    end, cpu = time.time(), time.thread_time() - cpu
    event = {"id": call.id, "op": call.op, "kind": call.kind.value, "step": call.step,
             "chunk": call.chunk, "rank": call.rank, "role": call.role,
             "device": _STATE["device"], "worker": _STATE["address"],
             "start": start, "end": end,
             "version_read": info.get("version_read", -1),
             "version_written": info.get("version_written", -1),
             "stats": info.get("stats", {}), "cpu_s": round(cpu, 6),
             # the worker process's CPU so far (every thread): with the op CPU above, what
             # the worker spent outside ops (Dask's event loop, transfers) between two ops
             "proc_cpu_s": round(time.process_time(), 6)}
    with _LOCK:
        _EVENTS.append(event)
    return outputs


def run_group(calls, keep, where, *results):
    """Run fused calls in order (one Dask task); each is traced as its own op.

    ``where[i]`` says, for ``calls[i].deps``, where each result is: ``(j, op_id)`` for
    ``results[j][op_id]`` (an earlier task's group), or ``(-1, op_id)`` for a call earlier
    in this group (ordering dependencies are task arguments only: nothing of them is read).
    Returns ``{op_id: outputs}`` for the ids in ``keep``.
    """
    local: dict[str, object] = {}
    for call, refs in zip(calls, where, strict=True):
        args = [local[oid] if j < 0 else results[j][oid] for j, oid in refs]
        if call.role == JOIN:                  # no op: its inputs passed on as one value
            local[call.id] = Joined(tuple(args))
            continue
        try:
            local[call.id] = run_op(call, *args)
        except Exception as e:
            e.rpeg_op = call.id                # which op of the group failed
            raise
    return {k: v for k, v in local.items() if k in keep}


def drain() -> list[dict]:
    """Hand over (and forget) the trace events recorded since the last drain."""
    with _LOCK:
        out = list(_EVENTS)
        _EVENTS.clear()
    return out


def teardown() -> None:
    ex = _STATE.pop("executor", None)
    if ex is not None:
        ex.shutdown()
    if "torch.distributed" in sys.modules:
        import backends
        backends.load("torch", "shutdown_world")()
    _STATE.clear()


def _address() -> str:
    try:
        from distributed import get_worker
        return get_worker().address
    except (ImportError, ValueError):
        return "local"
