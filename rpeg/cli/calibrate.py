"""``rpeg calibrate [-o PROFILE.rpeg] [--cluster CLUSTER.rpeg]``: measure this machine.

    $ rpeg calibrate -o pipelines/clusters/profiles/local_cpu.rpeg \
          --cluster pipelines/clusters/local_cpu.rpeg
    fitted on 18 ops in 21 s: GEMM 107 GFLOPS, copy 37 GB/s, gloo 1.2 GB/s + 160 us
    wrote pipelines/clusters/profiles/local_cpu.rpeg

The measurements run in a child process with torch: ops are timed under glibc's default
allocator settings, as rpeg's workers run them, and peak memory is read in a grandchild
with glibc set to return freed memory (``MALLOC_ENV``), so readings start clean; the fit (``rpeg.cost.calibrate``) runs here and writes a
``profile`` block in the .rpeg language, and with ``--cluster`` the cluster file whose
GPU-level link is the measured gloo all-reduce between two Dask worker processes.
What Dask itself costs is measured here too: the gap one task adds
(``rpeg.runtime.calibrate.dispatch.measure_dispatch``) and the control plane's CPU per device
and per task in three short real runs (``measure_control``), which the cost model charges where the
devices share the host's cores; and what the control plane costs on a host of its own
(``measure_scheduler``: Dask's scheduler and client per task, future and worker with many
lightweight workers; ``measure_core``: the scheduling core per op call on a simulated
clock), which GPU clusters are priced with (``rpeg.cost.control``). ``--control-only
-o PROFILE.rpeg`` measures only those (on the host that will run the client and the
scheduler, for a GPU cluster's profile; on this machine, for the shipped CPU profile,
whose terms a GPU profile without its own is priced with).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import attrs
import typer

from rpeg.cli.output import writable, writing
from rpeg.errors import RpegError


def _control_line(p) -> str:
    if not p.host_cores:
        line = "control plane on the devices' cores not measured"
    else:
        line = (f"control plane {p.control_step_s * 1e3:.1f} ms CPU per device and "
                f"{p.control_task_s * 1e3:.2f} ms per task a step, idle "
                f"{p.control_idle * 1e3:.1f} ms per second per process, on "
                f"{p.host_cores:.0f} cores")
    if p.scheduler_task_s:
        line += (f"; on a host of its own: the scheduler {p.scheduler_task_s * 1e3:.2f} ms "
                 f"per task, {p.scheduler_arg_s * 1e3:.2f} ms per future, "
                 f"{p.scheduler_worker_s * 1e3:.2f} ms per worker a step; the client "
                 f"{(p.client_task_s + p.control_call_s) * 1e3:.2f} ms per task")
    return line


def _control_fit_line(c: dict | None, p) -> str:
    """How the control-plane terms reproduce each of their runs (``rpeg.cost.calibrate
    .control_residuals``), as one line; empty without runs."""
    from rpeg.cost.calibrate import control_residuals
    runs = control_residuals(c, p) if c else ()
    if not runs:
        return ""
    return "control plane runs, priced / measured - 1: " + ", ".join(
        f"{name.removeprefix('control plane, ')} {round(r * 100):+d}%" for name, r in runs)


def _usage(tools, arg, calls, cluster, name, repeats, save, dispatch_only, control_only,
           out) -> None:
    """Usage errors (exit 2), before minutes of measuring: options that do nothing with
    the others, a profile name the language cannot read back, an output of another kind."""
    def bad(text: str, hint: str) -> None:
        raise typer.BadParameter(text, param_hint=hint)

    if tools is not None:
        for given, flag in ((cluster, "--cluster"), (save, "--save-measurements"),
                            (dispatch_only, "--dispatch-only"), (control_only, "--control-only"),
                            (name != "local_cpu", "--name"), (repeats != 5, "--repeats")):
            if given:
                bad("measures the machine; --tools measures a pipeline's tools alone", flag)
    else:
        if arg:
            bad("is an argument of the tools --tools measures", "--arg")
        if calls != 20:
            bad("counts the calls of the tools --tools measures", "--calls")
    from rpeg.spec.parser import parse_text
    try:                                     # the profile the measuring will write, read back
        parse_text(f"profile {name} {{\n    memory = 1 GB\n}}\n", "<name>")
        named = True
    except RpegError:
        named = False
    if not named:
        bad(f"names the profile as the language writes a name (letters, digits, _), not "
            f"'{name}'", "--name")
    for path, flag in ((out, "--out"), (cluster, "--cluster")):
        if path is not None and not path.is_dir() and path.suffix != ".rpeg":
            bad(f"writes a .rpeg file, not '{path}'", flag)


def register(app: typer.Typer) -> None:
    @app.command()
    def calibrate(
        out: Path = typer.Option(None, "--out", "-o", help="Write the profile here (default: print it)."),
        cluster: Path = typer.Option(None, "--cluster", help="Also write the local cluster file here."),
        name: str = typer.Option("local_cpu", help="Profile name."),
        repeats: int = typer.Option(5, min=1, max=50, help="Timed calls per measurement."),
        save: Path = typer.Option(None, "--save-measurements", help="Keep the raw measurements (JSON)."),
        dispatch_only: bool = typer.Option(False, "--dispatch-only", help="Measure only what "
                                           "Dask costs (the dispatch gap, the control plane's "
                                           "CPU in three short runs on a CPU profile, and per "
                                           "task, future and worker on a host of its own) and "
                                           "update those terms of the --out profile, keeping "
                                           "the rest."),
        control_only: bool = typer.Option(False, "--control-only", help="Measure only what "
                                          "the control plane costs on a host of its own "
                                          "(Dask's scheduler and client per task, future and "
                                          "worker with many lightweight workers; the "
                                          "scheduling core per op call), the terms GPU "
                                          "clusters are priced with, and update those terms "
                                          "of the --out profile, keeping the rest."),
        tools: Path = typer.Option(None, "--tools", help="Measure the tools and environments "
                                   "this pipeline declares, in the sandbox, and what a "
                                   "sandboxed call costs by itself (with --out: into that "
                                   "profile's tool_call_s, keeping the rest)."),
        arg: list[str] = typer.Option(None, "--arg", help="With --tools: an argument text to "
                                      "call each tool with (repeat it; default: empty)."),
        calls: int = typer.Option(20, "--calls", min=1, max=10000,
                                  help="With --tools: calls per tool."),
    ) -> None:
        """Measure this machine's devices and links into a hardware profile."""
        _usage(tools, arg, calls, cluster, name, repeats, save, dispatch_only, control_only,
               out)
        if tools is not None:
            _tools(tools, list(arg or []), calls, out)
            return
        from rpeg.cost.calibrate import (
            cluster_text,
            fit_scheduler,
            keep_unmeasured,
            with_dispatch,
        )
        from rpeg.cost.profiles import load_profile, profile_text
        from rpeg.runtime.calibrate.dispatch import (
            measure_control,
            measure_dispatch,
            measure_scheduler,
        )
        from rpeg.runtime.calibrate.machine import RUN_DECODE, fit_machine, measure_machine
        from rpeg.runtime.calibrate.simulated import measure_core
        t0 = time.perf_counter()
        for path, option in ((out, "--out"), (cluster, "--cluster"),
                             (save, "--save-measurements")):
            writable(path, option)                   # before minutes of measuring, not after
        if dispatch_only or control_only:
            flag = "--dispatch-only" if dispatch_only else "--control-only"
            if out is None:
                raise typer.BadParameter("updates an existing profile: give it with --out "
                                         "PROFILE.rpeg", param_hint=flag)
            if not out.is_file():
                raise RpegError(f"{flag} updates an existing profile, and '{out}' "
                                "is none", hint="measure the whole profile first: rpeg "
                                                f"calibrate -o {out}")
        if control_only:
            s, core = measure_scheduler(), measure_core()
            p = attrs.evolve(load_profile(out), **fit_scheduler(s, core))
            note = (f"{p.name}: measured by rpeg calibrate, its control plane on a host of its "
                    f"own by rpeg calibrate --control-only at load {s['loadavg']:.1f}")
            with writing(out, "the profile") as tmp:
                tmp.write_text(profile_text(p, comment=note))
            print(f"{_control_line(p)} (fleets of {', '.join(str(r['workers']) for r in s['rows'])}"
                  f" workers, load {s['loadavg']:.1f}); wrote {out}", file=sys.stderr)
            return
        if dispatch_only:
            d = measure_dispatch()
            old = load_profile(out)
            # a profile of the devices' own cores gets their control plane measured too;
            # every profile, what the control plane costs on a host of its own
            c = measure_control() if old.host_cores else None
            p = with_dispatch(old, d, c, measure_scheduler(), measure_core())
            with writing(out, "the profile") as tmp:
                tmp.write_text(profile_text(p, comment=f"{p.name}: measured by rpeg calibrate"))
            print(f"dispatch {d['dispatch_s'] * 1e3:.2f} ms per task (one worker "
                  f"{d['same_worker_s'] * 1e3:.2f} ms, across two {d['cross_worker_s'] * 1e3:.2f}"
                  f" ms, load {d['loadavg']:.1f}); {_control_line(p)}; wrote {out}",
                  file=sys.stderr)
            if line := _control_fit_line(c, p):
                print(line, file=sys.stderr)
            return
        m = measure_machine(repeats, scheduler=True)
        if save:
            with writing(save, "the measurements") as tmp:
                tmp.write_text(json.dumps(m))
        fit = fit_machine(m, name=name)       # fit_profile, and the runs' generate ops
        p = fit.profile
        if out is not None and out.exists():
            p = keep_unmeasured(fit, load_profile(out))
        text = profile_text(p, comment=f"{name}: measured by rpeg calibrate")
        print(f"fitted on {len(m['ops'])} ops in {time.perf_counter() - t0:.0f} s: "
              f"GEMM {p.matmul_flops / 1e9:.0f} GFLOPS, copy {p.mem_bandwidth / 1e9:.0f} GB/s, "
              f"gloo {fit.link.bandwidth / 1e9:.2f} GB/s + {fit.link.latency * 1e6:.0f} us",
              file=sys.stderr)
        print(_control_line(p), file=sys.stderr)
        if line := _control_fit_line(m.get("control"), p):
            print(line, file=sys.stderr)
        if "dp_tensor_overhead" in fit.measured:
            print(f"data-parallel training over two workers: {p.dp_tensor_overhead * 1e6:.0f} "
                  f"us of host work per parameter tensor per step, FSDP2 "
                  f"{p.shard_tensor_overhead * 1e6:.0f} us more, and "
                  f"{p.shard_layer_overhead * 1e6:.0f} us per layer per micro-batch",
                  file=sys.stderr)
        if "tp_layer_overhead" in fit.measured:
            print(f"tensor-parallel ops over two workers: {p.tp_layer_overhead * 1e6:.0f} us "
                  f"of host work and waits per layer per pass", file=sys.stderr)
        runs = dict(fit.residuals).get(RUN_DECODE)
        if runs is not None:
            print(f"a generate op in the real runs: {runs * 1e6:+.0f} us per decode step beyond "
                  f"its price (decode_overhead {p.decode_overhead * 1e6:.0f} us)",
                  file=sys.stderr)
        worst = max((r for r in fit.residuals if r[0] != RUN_DECODE), key=lambda r: abs(r[1]))
        print(f"fit residuals: worst {worst[0]} {worst[1] * 100:+.0f}%", file=sys.stderr)
        if out is None:
            print(text, end="")
        else:
            with writing(out, "the profile") as tmp:
                tmp.write_text(text)
            print(f"wrote {out}", file=sys.stderr)
        if cluster is not None:
            rel = os.path.relpath(out, cluster.parent) if out else f"profiles/{name}.rpeg"
            with writing(cluster, "the cluster file") as tmp:
                tmp.write_text(cluster_text(name, rel, fit.link))
            print(f"wrote {cluster}", file=sys.stderr)


def _tools(spec: Path, args: list[str], calls: int, out: Path | None) -> None:
    """``rpeg calibrate --tools SPEC``: each tool's latency as the policy waits for it,
    with the distribution to declare, and a sandboxed call's own cost."""
    import numpy as np

    from rpeg.cost.profiles import load_profile, profile_text
    from rpeg.runtime.usercode.sandbox import Sandbox, measure, measure_environment, probe_tool
    from rpeg.spec import load
    writable(out, "--out")
    if out is not None and not out.is_file():
        raise RpegError(f"--tools with --out updates an existing profile's tool_call_s, and "
                        f"'{out}' is none", hint=f"measure the whole profile first: rpeg "
                                                 f"calibrate -o {out}")
    pipeline = load(spec)
    probe = probe_tool()
    box = Sandbox.start(list(pipeline.tools) + [probe], slots=1)
    try:
        box.call_many([(probe.name, "")])                 # the first call warms the server
        base, _ = measure(box, probe.name, [""], max(calls, 20))
        print(f"a sandboxed call that answers at once: median {np.median(base) * 1e3:.1f} ms "
              f"(tool_call_s), max {max(base) * 1e3:.1f} ms, over {len(base)} calls, "
              f"landlock ABI {box.landlock}", file=sys.stderr)
        for t in pipeline.tools:
            fn = measure_environment if t.environment else measure
            seconds, failed = fn(box, t.name, args, calls)
            if not seconds:
                print(f"{t.name}: every call failed", file=sys.stderr)
                continue
            median, top = float(np.median(seconds)), float(max(seconds))
            print(f"{'environment' if t.environment else 'tool'} {t.name}: {len(seconds)} "
                  f"calls, median {median * 1e3:.1f} ms, p90 "
                  f"{np.percentile(seconds, 90) * 1e3:.1f} ms, max {top * 1e3:.1f} ms"
                  + (f", {failed} failed" if failed else ""), file=sys.stderr)
            print(f"  declare: latency = lognormal(median = {_ms(median)}, max = "
                  f"{_ms(max(top, median))})")
    finally:
        box.close()
    if out is not None:
        import attrs
        p = attrs.evolve(load_profile(out), tool_call_s=float(np.median(base)))
        with writing(out, "the profile") as tmp:
            tmp.write_text(profile_text(p, comment=f"{p.name}: measured by rpeg calibrate"))
        print(f"wrote {out}", file=sys.stderr)


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"
