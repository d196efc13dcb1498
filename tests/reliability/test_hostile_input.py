"""Hostile and broken input: every refusal is an RpegError naming the file, without hanging.

Truncated, corrupted, binary, wrong-kind and absurd .rpeg files; files that are
not files (pipes, devices, directories); sizes no cluster has; extends that nest
too deep or loop. None may produce a traceback, hang, or read a huge file whole.
A refusal runs under a hang guard (``no_hang``: minutes, whatever the machine's
load), not a speed target: how quickly rpeg refuses is no test's business.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import resource
import shutil
import signal
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpeg.cli import main as cli_main
from rpeg.errors import RpegError, SpecError
from rpeg.spec import check_file, load, load_cluster
from rpeg.spec.parser import MAX_SOURCE_BYTES

ROOT = Path(__file__).resolve().parents[2]
PIPELINES = ROOT / "pipelines"
SHIPPED = sorted(PIPELINES.glob("*.rpeg")) + sorted((PIPELINES / "clusters").glob("*.rpeg"))


HANG_S = 120.0     # a refusal still running after this long is a hang, on any machine


@contextlib.contextmanager
def no_hang(seconds: float = HANG_S):
    """Fail the block if it runs past ``seconds`` (SIGALRM; the main thread only)."""
    def alarm(signum, frame):
        raise TimeoutError(f"still running after {seconds:.0f} s: a hang")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def refused(path: Path, *, contains: str = "") -> SpecError:
    """check_file(path) must raise a SpecError naming ``path``, and not hang."""
    with no_hang(), pytest.raises(SpecError) as info:
        check_file(path)
    err = info.value
    assert err.span is not None and Path(err.span.path).name, err
    assert contains in str(err) + (err.hint or ""), str(err)
    err.render()
    return err


def copy_pipeline(tmp_path: Path, name: str = "tiny_ppo.rpeg") -> Path:
    shutil.copy(PIPELINES / "rewards.py", tmp_path / "rewards.py")
    dst = tmp_path / name
    shutil.copy(PIPELINES / name, dst)
    return dst


def test_huge_spec_is_refused_by_size_without_being_read(tmp_path):
    big = tmp_path / "big.rpeg"
    with big.open("wb") as fh:          # sparse: 1 GB on paper, nothing on disk
        fh.truncate(1 << 30)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    err = refused(big, contains="at most")
    grew_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    assert str(big) in str(err) and "1,073,741,824" in str(err)
    assert grew_kb < 100_000, f"memory grew {grew_kb} KB checking a file refused by size"


def test_file_just_over_the_limit_is_refused(tmp_path):
    f = tmp_path / "over.rpeg"
    f.write_bytes(b"#" * (MAX_SOURCE_BYTES + 1))
    refused(f, contains="at most")


def test_a_pipe_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "spec.rpeg"
    os.mkfifo(fifo)
    box: dict[str, BaseException] = {}

    def attempt() -> None:
        try:
            check_file(fifo)
        except BaseException as e:  # noqa: BLE001 — carried to the main thread
            box["err"] = e

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(HANG_S)
    if t.is_alive():                     # unblock the reader so the thread can end
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        pytest.fail("check_file blocked on a named pipe")
    assert isinstance(box.get("err"), SpecError) and "not a regular file" in str(box["err"])


@pytest.mark.parametrize("make, says", [
    (lambda p: p.mkdir(), "directory"),
    (lambda p: None, "no such file"),
    (lambda p: p.write_bytes(b""), "holds nothing"),
    (lambda p: p.write_text("# only a comment\n"), "only comments"),
    (lambda p: p.write_bytes(b"pipeline p\n\x00\x01\x02"), "binary"),
    (lambda p: p.write_bytes(b"pipeline p\n\xff\xfe oops"), "UTF-8"),
    (lambda p: p.write_bytes(os.urandom(4096)), ""),
    (lambda p: p.write_text("\ufeffpipeline p\n"), "workload"),
    (lambda p: p.write_text("pipeline p\nworkload { steps = " + "[" * 100_000 + "]" * 100_000
                            + " }\n"), "nest"),
    (lambda p: p.write_text("pipeline p\nextend \"a\\u0000b\"\n"), "NUL"),
    (lambda p: p.write_text('pipeline p\nextend "/dev/zero"\n'), "extend"),
    (lambda p: p.write_text('pipeline p\nextend "/dev/stdin"\n'), "extend"),
], ids=["dir", "missing", "empty", "comments", "binary", "not-utf8", "random", "bom",
        "deep-brackets", "nul", "extend-device", "extend-stdin"])
def test_broken_files_are_refused_with_a_message(tmp_path, make, says):
    f = tmp_path / "x.rpeg"
    make(f)
    refused(f, contains=says)


def test_very_long_lines_are_excerpted_not_dumped(tmp_path):
    f = tmp_path / "long.rpeg"
    f.write_text("pipeline p\n" + "x" * 100_000 + " = 3 %\n")
    text = refused(f).render()
    assert max(len(line) for line in text.splitlines()) < 400


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_truncated_and_corrupted_shipped_files(tmp_path, path):
    """Every cut and some byte flips of each shipped spec: accepted, or refused naming it."""
    shutil.copy(PIPELINES / "rewards.py", tmp_path / "rewards.py")
    shutil.copytree(PIPELINES / "clusters" / "profiles", tmp_path / "profiles")
    for base in PIPELINES.glob("*.rpeg"):          # bases that 'extend' may name
        shutil.copy(base, tmp_path / base.name)
    data = path.read_bytes()
    rng = random.Random(path.name)
    target = tmp_path / ("cut_" + path.name)
    cuts = sorted({len(data) * k // 12 for k in range(12)})
    flips = [rng.randrange(len(data)) for _ in range(6)]
    variants = [data[:c] for c in cuts] + [
        data[:i] + bytes([rng.randrange(256)]) + data[i + 1:] for i in flips]
    for raw in variants:
        target.write_bytes(raw)
        try:
            check_file(target)
        except SpecError as e:
            assert e.span is not None and e.span.path, e
            e.render()


@pytest.mark.parametrize("edit, says", [
    ((r"steps\s*=\s*\d+", "steps = 1000000000"), "at most"),
    ((r"prompts\s*=\s*\d+", "prompts = 1000000000000"), "at most"),
    ((r"samples\s*=\s*\d+", "samples = 99999999999999999999"), "at most"),
    ((r"max\s*=\s*\d+\)", "max = 1000000000000)"), "at most"),
    ((r"steps\s*=\s*\d+", "steps = 1e999"), "integer"),
    ((r"steps\s*=\s*\d+", "steps = -1"), ""),
], ids=["1e9-steps", "1e12-prompts", "1e20-samples", "1e12-gen-len", "inf-steps", "neg-steps"])
def test_absurd_pipeline_sizes_are_refused(tmp_path, edit, says):
    f = copy_pipeline(tmp_path)
    text, n = re.subn(edit[0], edit[1], f.read_text(), count=1)
    assert n == 1, edit
    f.write_text(text)
    refused(f, contains=says)


@pytest.mark.parametrize("body, says", [
    ("gpus_per_node = 1000000000000", "at most"),
    ("gpus_per_node = 8\n nodes_per_rack = 1000000\n racks = 1000000\n"
     " link gpu { bandwidth = 1 GB/s; latency = 1 us }\n"
     " link node { bandwidth = 1 GB/s; latency = 1 us }\n"
     " link rack { bandwidth = 1 GB/s; latency = 1 us }", "at most"),
    ("gpus_per_node = 0", "at least"),
], ids=["1e12-gpus", "1e13-gpus-by-product", "zero"])
def test_absurd_clusters_are_refused(tmp_path, body, says):
    f = tmp_path / "c.rpeg"
    f.write_text(f"cluster c {{\n gpu = h100\n {body}\n}}\n")
    with no_hang(), pytest.raises(SpecError, match=says):
        load_cluster(f)


def test_deep_extend_chain_is_refused(tmp_path):
    shutil.copy(PIPELINES / "rewards.py", tmp_path / "rewards.py")
    shutil.copy(PIPELINES / "tiny_ppo.rpeg", tmp_path / "p0.rpeg")
    for n in range(1, 40):
        (tmp_path / f"p{n}.rpeg").write_text(f'pipeline p{n}\nextend "p{n - 1}.rpeg"\n')
    refused(tmp_path / "p39.rpeg", contains="deeper than")
    assert load(tmp_path / "p3.rpeg").name == "p3"     # a short chain is fine


def test_extend_cycle_is_refused(tmp_path):
    (tmp_path / "a.rpeg").write_text('pipeline a\nextend "b.rpeg"\n')
    (tmp_path / "b.rpeg").write_text('pipeline b\nextend "a.rpeg"\n')
    refused(tmp_path / "a.rpeg", contains="cycle")


def test_histogram_that_is_a_pipe_is_refused(tmp_path):
    f = copy_pipeline(tmp_path)
    os.mkfifo(tmp_path / "lengths.csv")
    text, n = re.subn(r"uniform\([^)]*\)", 'empirical("lengths.csv")', f.read_text(), count=1)
    assert n == 1
    f.write_text(text)
    refused(f, contains="histogram")


def test_wrong_kind_of_file(tmp_path):
    with pytest.raises(SpecError, match="not a cluster"):
        load_cluster(PIPELINES / "tiny_ppo.rpeg")
    with pytest.raises(SpecError, match="not a pipeline"):
        load(PIPELINES / "clusters" / "local_cpu.rpeg")


def test_checking_a_spec_runs_none_of_its_code(tmp_path, monkeypatch):
    """python("pkg.mod:fn") is resolved by reading source, not importing: pkg/__init__.py
    would leave a marker if anything imported it."""
    pkg = tmp_path / "site" / "sneaky"
    pkg.mkdir(parents=True)
    marker = tmp_path / "ran"
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    (pkg / "rw.py").write_text(f"open({str(marker)!r}, 'w').write('x')\ndef score(prompts, responses, answers): return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    spec_dir = tmp_path / "spec"
    spec_dir.mkdir()
    f = copy_pipeline(spec_dir)
    f.write_text(f.read_text().replace("rewards:toy_reward", "sneaky.rw:score"))
    assert load(f).rewards[0].module == "sneaky.rw"
    f.write_text(f.read_text().replace("sneaky.rw:score", "sneaky.rw:nothing"))
    refused(f, contains="no function 'nothing'")
    assert not marker.exists(), "checking the spec ran the reward module's code"


def test_cli_never_prints_a_traceback(tmp_path, capsys):
    inputs = []
    for n, raw in enumerate([b"", b"\x00" * 10, os.urandom(300), b"pipeline\n",
                             b"cluster c { gpus_per_node = 1000000000000000000000 }",
                             b"pipeline p\nworkload { steps = " + b"(" * 5000 + b"}"]):
        p = tmp_path / f"in{n}.rpeg"
        p.write_bytes(raw)
        inputs.append(str(p))
    rc = cli_main(["check", *inputs, str(tmp_path / "missing.rpeg")])
    err = capsys.readouterr().err
    assert rc == 1
    assert "Traceback" not in err and "internal error" not in err
    assert err.count("error:") >= len(inputs) + 1


# --- the short in-suite fuzz (the long one is benchmarks/fuzz.py) -------------

_SEEDS = [p.read_bytes() for p in SHIPPED]
_TOKENS = [b"0", b"-1", b"1e999", b"99999999999999999999", b'"/dev/zero"', b'"../x"', b"[[[",
           b"{", b"}", b"->", b"<=", b"\xff", b"\x00", b'"\\u0000"', b"python(\"os:system\")"]


@st.composite
def _mutants(draw):
    if draw(st.booleans()):
        return draw(st.binary(max_size=400))
    data = bytearray(draw(st.sampled_from(_SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data)))
        if draw(st.booleans()):
            data[i:i + draw(st.integers(0, 40))] = b""
        else:
            data[i:i] = draw(st.sampled_from(_TOKENS))
    return bytes(data)


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(_mutants())
def test_fuzz_front_end_never_crashes(tmp_path_factory, data):
    from rpeg.spec.parser import parse_bytes
    from rpeg.spec.resolve import FileKind, file_kind

    where = PIPELINES / "clusters" if b"cluster" in data[:2000] else PIPELINES
    path = str(where / "fuzz_input.rpeg")
    try:
        f = parse_bytes(data, path)
        kind = file_kind(f)
        if kind is FileKind.PIPELINE:
            from rpeg.spec.lower import lower_pipeline
            lower_pipeline(f)
        elif kind is FileKind.CLUSTER:
            from rpeg.spec.cluster import lower_cluster
            lower_cluster(f)
    except RpegError as e:
        assert e.span is not None and e.span.path
        e.render()


# --- plan.json ----------------------------------------------------------------------------

def _a_plan_json() -> str:
    from rpeg.runtime.placement import split_plan
    return split_plan(load(PIPELINES / "tiny_ppo.rpeg"), 2, staleness=1).to_json()


def _plan_refused(path: Path, says: str = "") -> None:
    from rpeg.errors import PlanError
    from rpeg.plan.model import Plan

    with no_hang(), pytest.raises(PlanError) as info:
        Plan.load(path)
    assert info.value.span is not None and info.value.span.path == str(path), info.value
    assert says in str(info.value), str(info.value)


def test_plan_files_truncated_anywhere_are_refused(tmp_path):
    from rpeg.plan.model import Plan

    text = _a_plan_json()
    f = tmp_path / "plan.json"
    f.write_text(text)
    assert Plan.load(f).num_devices == 2
    for cut in range(0, len(text) - 2, max(1, len(text) // 40)):
        f.write_text(text[:cut])
        _plan_refused(f)


@pytest.mark.parametrize("edit, says", [
    (lambda d: d.update(schema_version=99), "schema_version"),
    (lambda d: d.update(num_devices=10**12), "num_devices"),
    (lambda d: d.update(num_devices="two"), "well-formed"),
    (lambda d: d["placements"][0].update(devices=[-1]), "devices"),
    (lambda d: d["placements"][0].update(chunks=10**9), "chunks"),
    (lambda d: d["placements"].append(d["placements"][0]), "twice"),
    (lambda d: d.pop("placements"), "well-formed"),
], ids=["version", "1e12-devices", "type", "negative-device", "1e9-chunks", "duplicate",
        "missing"])
def test_plan_files_with_wrong_fields_are_refused(tmp_path, edit, says):
    import json

    data = json.loads(_a_plan_json())
    edit(data)
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(data))
    _plan_refused(f, says)


def test_plan_file_that_is_huge_a_pipe_or_binary_is_refused(tmp_path):
    big = tmp_path / "big.json"
    with big.open("wb") as fh:
        fh.truncate(1 << 30)
    _plan_refused(big, "at most")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    _plan_refused(fifo, "regular file")
    binary = tmp_path / "bin.json"
    binary.write_bytes(os.urandom(2048))
    _plan_refused(binary)


# --- run directories ----------------------------------------------------------------------

@pytest.mark.parametrize("name, content", [
    ("run.json", b"{"), ("run.json", b"[]"), ("run.json", b'{"steps": "many"}'),
    ("trace.json", b'{"traceEvents": [{"ph": "X"}]}'), ("trace.json", os.urandom(512)),
    ("plan.json", b'{"schema_version": 1}'), ("pipeline.json", b'{"__type__": "os:system"}'),
    ("pipeline.json", b"\x80\x04\x95pickle"),
], ids=["run-truncated", "run-list", "run-steps", "trace-event", "trace-random", "plan-empty",
        "pipeline-foreign-type", "pipeline-pickle"])
def test_verify_and_resume_refuse_damaged_run_directories(tmp_path, capsys, name, content):
    import json

    from rpeg.runtime.placement import split_plan
    from rpeg.runtime.rundir.serial import dumps

    pipeline = load(PIPELINES / "tiny_ppo.rpeg")
    run = tmp_path / "run"
    run.mkdir()
    (run / "pipeline.json").write_text(dumps(pipeline))
    (run / "plan.json").write_text(split_plan(pipeline, 2, staleness=1).to_json())
    (run / "run.json").write_text(json.dumps({"steps": 1, "status": "failed"}))
    (run / "trace.json").write_text(json.dumps({"traceEvents": []}))
    (run / name).write_bytes(content)
    for argv in (["verify", str(run)], ["run", "--resume", str(run), "--no-progress"]):
        rc = cli_main(argv)
        err = capsys.readouterr().err
        if argv[0] == "run" and name == "trace.json":
            continue               # resume reads checkpoints, not the trace: nothing to refuse
        assert rc == 1, (argv, err)
        assert "Traceback" not in err and "internal error" not in err, err
        assert str(run) in err
