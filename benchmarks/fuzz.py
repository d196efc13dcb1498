"""Fuzz the front end (parser + checker, and plan.json loading once plans exist).

    $ .venv/bin/python benchmarks/fuzz.py --runs 100000            # atheris if installed
    $ .venv/bin/python benchmarks/fuzz.py --engine mutate --runs 2000 -o /tmp/fuzz.json

Every input is handed to the same code path ``rpeg check`` uses. An input
passes when it is accepted or refused with an :class:`rpeg.errors.RpegError`
whose message names the file; anything else (another exception, a check
taking longer than ``--slow`` seconds) is a *crash*, recorded with the input in
``benchmarks/results/fuzz.json``. Nothing is re-raised, so one run always
covers the requested number of inputs.

Engines:
- ``atheris``: coverage-guided (libFuzzer) byte mutations of the shipped
  pipelines, clusters and profiles. Runs in a child process; counts are
  written by the target itself, since libFuzzer ends the process when done.
- ``mutate``: a seeded, structure-aware mutator (line deletions, swaps,
  splices, hostile tokens: huge numbers, paths to devices, deep brackets,
  invalid UTF-8) plus random text; reproducible from ``--seed``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import finish, provenance  # noqa: E402
from rpeg.errors import RpegError  # noqa: E402
from rpeg.spec.parser import parse_bytes  # noqa: E402

PIPELINES = ROOT / "pipelines"
CLUSTERS = PIPELINES / "clusters"


def seeds() -> list[tuple[str, bytes]]:
    files = sorted(PIPELINES.glob("*.rpeg")) + sorted(CLUSTERS.glob("*.rpeg")) + sorted(
        (CLUSTERS / "profiles").glob("*.rpeg"))
    return [(str(p.relative_to(ROOT)), p.read_bytes()) for p in files]


def _virtual_path(data: bytes) -> str:
    # relative references (extend, rewards, gpu profiles) resolve against the seed's folder
    if b"cluster" in data[:4096] or b"profile" in data[:4096]:
        return str(CLUSTERS / "fuzz_input.rpeg")
    return str(PIPELINES / "fuzz_input.rpeg")


def check_bytes(data: bytes) -> str:
    """'ok' or 'refused'; raises anything that is not an RpegError naming the file."""
    from rpeg.spec.cluster import lower_cluster, lower_profile
    from rpeg.spec.lower import lower_pipeline
    from rpeg.spec.resolve import FileKind, file_kind

    path = _virtual_path(data)
    try:
        f = parse_bytes(data, path)
        kind = file_kind(f)
        if kind is FileKind.PIPELINE:
            lower_pipeline(f)
        elif kind is FileKind.CLUSTER:
            lower_cluster(f)
        else:
            lower_profile(f)
        return "ok"
    except RpegError as e:
        e.render()   # rendering the diagnostic must not fail either
        if e.span is None or e.span.path in ("", "<builtin>", "<string>"):
            raise AssertionError(f"error does not name the file: {e}") from None
        return "refused"


def check_plan_bytes(data: bytes) -> str:
    """plan.json loading: accepted, or a PlanError naming the file."""
    from rpeg.plan.model import Plan

    try:
        Plan.from_json(data.decode("utf-8", errors="replace"), "fuzz_plan.json")
        return "ok"
    except RpegError as e:
        e.render()
        if e.span is None or e.span.path != "fuzz_plan.json":
            raise AssertionError(f"error does not name the file: {e}") from None
        return "refused"


def plan_seeds() -> list[bytes]:
    from rpeg.runtime.placement import split_plan
    from rpeg.spec import load

    out = []
    for name in ("tiny_ppo.rpeg", "tiny_grpo.rpeg"):
        p = load(PIPELINES / name)
        for k in (0, 1):
            out.append(split_plan(p, 2, staleness=k).to_json().encode())
    return out


class Recorder:
    """Counts inputs and outcomes; keeps the first crashes with their inputs."""

    def __init__(self, out: Path, engine: str, runs: int, slow: float) -> None:
        self.out, self.engine, self.runs, self.slow = out, engine, runs, slow
        self.counts = {"ok": 0, "refused": 0, "crash": 0, "slow": 0, "skipped": 0}
        self.crashes: list[dict] = []
        self.tried = 0
        self.max_s = 0.0
        self.t0 = time.perf_counter()
        self.provenance = provenance()

    def one(self, data: bytes, check=check_bytes) -> None:
        t = time.perf_counter()
        try:
            outcome = check(data)
        except Exception as e:  # noqa: BLE001 — every escape is the finding we look for
            outcome = "crash"
            self._crash(data, e)
        dt = time.perf_counter() - t
        self.max_s = max(self.max_s, dt)
        if dt > self.slow:
            self.counts["slow"] += 1
            self._crash(data, TimeoutError(f"took {dt:.2f} s"))
        self.counts[outcome] += 1
        self.tried += 1
        if self.tried % 5000 == 0 or self.tried == self.runs:
            self.write()

    def _crash(self, data: bytes, e: BaseException) -> None:
        if len(self.crashes) >= 50:
            return
        tb = traceback.extract_tb(e.__traceback__)
        where = f"{tb[-1].filename}:{tb[-1].lineno}" if tb else ""
        self.crashes.append({"error": f"{type(e).__name__}: {str(e)[:300]}", "where": where,
                             "input_b64": base64.b64encode(data[:4096]).decode()})

    def write(self) -> None:
        elapsed = time.perf_counter() - self.t0
        result = {
            "engine": self.engine, "inputs_tried": self.tried, "runs_requested": self.runs,
            "outcomes": self.counts, "crashes_found": len(self.crashes),
            "crashes": self.crashes, "slowest_input_s": round(self.max_s, 4),
            "slow_limit_s": self.slow, "elapsed_s": round(elapsed, 1),
            "inputs_per_s": round(self.tried / elapsed, 1) if elapsed else 0.0,
            "seeds": [name for name, _ in seeds()],
            "command": self.provenance["command"],
            "provenance": finish(self.provenance),
        }
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(self.out)


# --- the structure-aware mutator ----------------------------------------------

HOSTILE = [
    b"0", b"-1", b"1e999", b"-1e999", b"99999999999999999999999", b"1000000000000", b"nan",
    b"1e-320", b'"/dev/zero"', b'"/dev/stdin"', b'"../../../../etc/passwd"', b'"."', b'""',
    b'"\\x00"', b'"\\u0000"', b"\xff\xfe", b"\x00", b"[" * 70 + b"]" * 70, b"(" * 50,
    b"{", b"}", b"->", b"<=", b"..", b"1..0", b"GB/s", b"TFLOPS", b"us", b"python(\"os:system\")",
    b'python("rewards:exact_match")', b"extend \"ppo_llama8b.rpeg\"", b'extend "fuzz_input.rpeg"',
    b"share actor, actor", b"staleness rollout <= 99999999", b"colocate", b"place rollout on",
    b"steps = 1000000000", b"gpus_per_node = 1000000000000", b"racks = 0", b"\t", b"\r\n",
    "\ufeff".encode(), "é".encode(), b"\xe2\x80\xae",
    b"null", b"[]", b"{}", b"true", b'"schema_version": 2,', b'"num_devices": 1e308,',
    b'"devices": [-1],', b'"dp": 0,', b'"__type__": "os:system",',
]


def mutate(rng: random.Random, base: bytes, corpus: list[bytes]) -> bytes:
    lines = base.split(b"\n")
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(9)
        i = rng.randrange(len(lines)) if lines else 0
        if not lines:
            lines = [b""]
        if op == 0:
            del lines[i]
        elif op == 1:
            lines.insert(i, lines[rng.randrange(len(lines))])
        elif op == 2:
            j = rng.randrange(len(lines))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == 3:  # replace a word with a hostile token
            words = lines[i].split(b" ")
            k = rng.randrange(len(words))
            words[k] = rng.choice(HOSTILE)
            lines[i] = b" ".join(words)
        elif op == 4:  # splice a line from another seed
            other = rng.choice(corpus).split(b"\n")
            lines.insert(i, rng.choice(other))
        elif op == 5:  # flip bytes
            b = bytearray(lines[i])
            for _ in range(rng.randint(1, 3)):
                if b:
                    b[rng.randrange(len(b))] = rng.randrange(256)
            lines[i] = bytes(b)
        elif op == 6:  # truncate
            joined = b"\n".join(lines)
            return joined[: rng.randrange(len(joined) + 1)]
        elif op == 7:  # insert a hostile token inside a line
            s = lines[i]
            k = rng.randrange(len(s) + 1)
            lines[i] = s[:k] + rng.choice(HOSTILE) + s[k:]
        else:  # drop a character
            s = lines[i]
            if s:
                k = rng.randrange(len(s))
                lines[i] = s[:k] + s[k + 1:]
    return b"\n".join(lines)


def random_text(rng: random.Random) -> bytes:
    alphabet = b"abcdefghijklmnopqrstuvwxyz_0123456789 ={}()[],:;.\"-<>#\n\t+*/\\"
    n = rng.randint(0, 300)
    if rng.random() < 0.2:
        return bytes(rng.randrange(256) for _ in range(n))
    return bytes(rng.choice(alphabet) for _ in range(n))


def run_mutate(rec: Recorder, runs: int, seed: int) -> None:
    """90% .rpeg inputs (mutated seeds, some random text), 10% plan.json mutations."""
    rng = random.Random(seed)
    corpus = [data for _, data in seeds()]
    plans = plan_seeds()
    for data in corpus:
        rec.one(data)
    for data in plans:
        rec.one(data, check_plan_bytes)
    while rec.tried < runs:
        r = rng.random()
        if r < 0.1:
            rec.one(mutate(rng, rng.choice(plans), plans), check_plan_bytes)
        elif r < 0.18:
            rec.one(random_text(rng))
        else:
            rec.one(mutate(rng, rng.choice(corpus), corpus))
    rec.write()


def run_atheris(rec: Recorder, runs: int, seed: int) -> None:
    import atheris

    corpus_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"rpeg-fuzz-corpus-{os.getpid()}"
    corpus_dir.mkdir(parents=True, exist_ok=True)
    for n, (_, data) in enumerate(seeds()):
        (corpus_dir / f"seed{n}.rpeg").write_bytes(data)

    def target(data: bytes) -> None:
        if rec.tried < runs:
            rec.one(data)

    atheris.instrument_all()   # coverage of everything imported so far: rpeg's front end
    atheris.Setup([sys.argv[0], f"-runs={runs}", f"-seed={seed + 1}", "-max_len=8192",
                   "-rss_limit_mb=4096", str(corpus_dir)], target)
    atheris.Fuzz()   # libFuzzer exits the process when the runs are done; rec.write() ran


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=100_000)
    ap.add_argument("--engine", choices=("atheris", "mutate", "both"), default="both")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slow", type=float, default=2.0, help="seconds after which an input counts "
                    "as a hang")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks/results/fuzz.json")
    args = ap.parse_args()
    started = provenance()
    if args.engine == "both":
        # half coverage-guided (in a child: libFuzzer ends its process), half structure-aware
        half = args.runs // 2
        part = args.out.with_name(args.out.stem + ".atheris.json")
        try:
            import atheris  # noqa: F401
            have_atheris = True
        except ImportError:
            have_atheris = False
        if have_atheris:
            subprocess.run([sys.executable, __file__, "--engine", "atheris", "--runs", str(half),
                            "--seed", str(args.seed), "--slow", str(args.slow), "-o", str(part)],
                           check=False)
        check_bytes(b"pipeline warm_up\n")
        rec = Recorder(args.out.with_name(args.out.stem + ".mutate.json"), "mutate",
                       args.runs - half if have_atheris else args.runs, args.slow)
        run_mutate(rec, rec.runs, args.seed)
        parts = [json.loads(p.read_text()) for p in (part, rec.out) if p.exists()]
        merged = {
            "inputs_tried": sum(p["inputs_tried"] for p in parts),
            "crashes_found": sum(p["crashes_found"] for p in parts),
            "engines": parts,
            "command": started["command"],          # benchmarks/reliability.py quotes it
            "provenance": finish(started),
        }
        args.out.write_text(json.dumps(merged, indent=2) + "\n")
        for p in (part, rec.out):
            p.unlink(missing_ok=True)
        print(f"fuzz: {merged['inputs_tried']:,} inputs, {merged['crashes_found']} crashes "
              f"-> {args.out}")
        return 1 if merged["crashes_found"] else 0
    check_bytes(b"pipeline warm_up\n")      # build the parser once, outside the timed inputs
    rec = Recorder(args.out, args.engine, args.runs, args.slow)
    if args.engine == "atheris":
        run_atheris(rec, args.runs, args.seed)
    else:
        run_mutate(rec, args.runs, args.seed)
    print(f"fuzz ({args.engine}): {rec.tried:,} inputs, {len(rec.crashes)} crashes -> {args.out}")
    return 1 if rec.crashes else 0


if __name__ == "__main__":
    sys.exit(main())
