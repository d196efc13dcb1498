"""The step counts a compile asks for, recorded and replayed: what a faster count
(``rpeg.plan.tasks.dispatch_per_step``, ``rpeg.plan.dispatchfloor.dispatch_floor``) must
give to the letter, and the CPU seconds it takes, apart from the rest of the search.

    .venv/bin/python benchmarks/dispatch_counts.py record /tmp/ppo256.pkl \\
        pipelines/ppo_llama8b.rpeg -c pipelines/clusters/gh200_256.rpeg
    .venv/bin/python benchmarks/dispatch_counts.py replay /tmp/ppo256.pkl

``record`` compiles (the arguments after the file are ``rpeg compile``'s; the plan goes to
a temporary folder) and keeps every count the control plane asks for, its arguments and
its result, in the order asked (the layouts shared between calls as the search shares
them). ``replay`` counts them all again with the code at hand: how many differ from the
recorded (none, for a count that keeps its values), and the process CPU seconds of the
first pass (the unrolled graphs not yet prepared) and the best of three warm ones.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path


def record(out: Path, argv: list[str]) -> int:
    import rpeg.plan.control as control
    from rpeg.cli import main

    asked: list[tuple] = []

    def kept(kind: str, count):
        def counted(*args, **kwargs):
            d = count(*args, **kwargs)
            asked.append((kind, args, kwargs, d))
            return d
        return counted

    control.dispatch_per_step = kept("count", control.dispatch_per_step)
    control.dispatch_floor = kept("floor", control.dispatch_floor)
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as quiet, \
            contextlib.redirect_stdout(quiet):
        rc = main(["compile", *argv, "--json", "--no-gantt", "-o", f"{tmp}/plan.json"])
    out.write_bytes(pickle.dumps(asked))
    print(f"{sum(k == 'count' for k, *_ in asked)} counts, "
          f"{sum(k == 'floor' for k, *_ in asked)} floors -> {out}")
    return rc or 0


def replay(path: Path) -> int:
    from rpeg.plan.dispatchfloor import dispatch_floor
    from rpeg.plan.tasks import dispatch_per_step

    asked = pickle.loads(path.read_bytes())
    of = {"count": dispatch_per_step, "floor": dispatch_floor}
    differ = 0
    for kind in of:
        calls = [(a, k, d) for kd, a, k, d in asked if kd == kind]
        t = time.process_time()
        differ += sum(of[kind](*a, **k) != d for a, k, d in calls)
        first = time.process_time() - t
        warm = []
        for _ in range(3):
            t = time.process_time()
            for a, k, _ in calls:
                of[kind](*a, **k)
            warm.append(time.process_time() - t)
        print(f"{kind}: {len(calls)} calls, first pass {first:.2f} CPU-s, "
              f"warm {min(warm):.2f} CPU-s")
    print(f"{differ} differ from the recorded")
    return 1 if differ else 0


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("record", "replay"):
        sys.exit(__doc__)
    if sys.argv[1] == "record":
        sys.exit(record(Path(sys.argv[2]), sys.argv[3:]))
    sys.exit(replay(Path(sys.argv[2])))
