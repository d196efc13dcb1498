"""What every results file records about how it was measured.

    >>> p = provenance()                                    # doctest: +SKIP
    >>> p["machine"]["cpu"], p["load_average"]["start"]     # doctest: +SKIP
    ('AMD EPYC', 1.4)
    >>> print(header(finish(p)))                            # doctest: +SKIP
    Command: `.venv/bin/python benchmarks/planner.py --quick`
    Machine: AMD EPYC, 2 cores (Linux-6.18 x86_64), python 3.11.7; 2026-12-01 22:10 UTC; load average 1.4 at the start, 1.2 at the end

The machine is the CPU model (``/proc/cpuinfo``) and its cores, the load average at the
start and at the end of the run (other work on the same cores changes what is
measured), the date, and the exact command as it was typed from the repository's root.
A benchmark that prices plans with a calibrated CPU profile also records the CPU that
profile was measured on (:func:`profile_origin`): its predictions are that machine's.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rpeg.runtime.calibrate.machine import MachineId, calibrated_on  # noqa: E402


def command(argv: list[str] | None = None) -> str:
    """The command that ran this script, as typed from the repository's root."""
    argv = sys.argv if argv is None else argv
    exe = Path(sys.executable)
    try:
        exe_text = str(exe.relative_to(ROOT))
    except ValueError:
        exe_text = exe.name
    script = Path(argv[0]).resolve() if argv else Path("?")
    try:
        script_text = str(script.relative_to(ROOT))
    except ValueError:
        script_text = str(argv[0]) if argv else "?"
    return shlex.join([exe_text, script_text, *argv[1:]])


def provenance(argv: list[str] | None = None) -> dict:
    """The record of a run about to start: command, date, machine, load at the start."""
    m = MachineId.here()
    return {"command": command(argv),
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": {"cpu": m.cpu, "cores": m.cores,
                        "platform": f"{platform.system()}-{platform.release()} "
                                    f"{platform.machine()}",
                        "python": platform.python_version()},
            "load_average": {"start": round(os.getloadavg()[0], 2)}}


def finish(p: dict) -> dict:
    """``p`` with the load average at the end of the run."""
    p["load_average"]["end"] = round(os.getloadavg()[0], 2)
    return p


def save(name: str, res: dict, text: str) -> None:
    """Write ``res`` to ``benchmarks/results/NAME.json`` and ``text`` beside it as .md."""
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
    (results / f"{name}.md").write_text(text)
    print(f"wrote {results / name}.json and .md")


def header(p: dict) -> str:
    """Two markdown lines for the top of a results file."""
    m, load = p["machine"], p["load_average"]
    end = f", {load['end']} at the end" if "end" in load else ""
    return (f"Command: `{p['command']}`  \n"
            f"Machine: {m['cpu']}, {m['cores']} cores ({m['platform']}), python "
            f"{m['python']}; {p['date']}; load average {load['start']} at the start{end}")


def profile_origin(cluster) -> dict:
    """Which profile a cluster prices with, and the CPU it was calibrated on (None for a
    profile of published GPU measurements)."""
    on = calibrated_on(cluster.gpu)
    return {"profile": cluster.gpu.name, "cluster": cluster.name,
            "calibrated_on": str(on) if on else None,
            "this_machine": on == MachineId.here() if on else None}
