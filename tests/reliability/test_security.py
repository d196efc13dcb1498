"""Security: the embedded cluster listens on loopback only; a remote scheduler is reached with
mutual TLS and refuses whoever lacks a certificate its CA signed; nothing read from disk is
unpickled."""

from __future__ import annotations

import logging
import os
import re
import socket
import ssl
from pathlib import Path

import psutil
import pytest

from rpeg.errors import RuntimeFailure
from rpeg.runtime.dask.security import (
    TlsFiles,
    check_scheduler_address,
    dask_tls,
    host_of,
    listening_addresses,
    security,
)

ROOT = Path(__file__).resolve().parents[2]


def _listening_ips(pid: int) -> set[str]:
    p = psutil.Process(pid)
    conns = p.net_connections(kind="inet") if hasattr(p, "net_connections") else \
        p.connections(kind="inet")
    return {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN}


def test_embedded_cluster_listens_on_loopback_only():
    from rpeg.runtime.dask.driver import DaskCluster

    with DaskCluster(2, None) as cl:
        addrs = listening_addresses(cl.client)
        assert len(addrs) >= 3                                 # scheduler + 2 workers (+ nannies)
        assert {host_of(a) for a in addrs.values()} == {"127.0.0.1"}, addrs
        worker_pids = set(cl.client.run(os.getpid).values())
        nanny_pids = set(cl.client.run(os.getppid).values())
        for pid in {os.getpid()} | worker_pids | nanny_pids:
            ips = _listening_ips(pid)
            assert ips <= {"127.0.0.1"}, f"process {pid} listens on {ips}"
        dash = cl.cluster.scheduler.services.get("dashboard")   # if there is one: loopback too
        if dash is not None:
            assert {s.getsockname()[0] for s in dash._sockets.values()} <= {"127.0.0.1"}


# --- TLS ------------------------------------------------------------------------------------

@pytest.fixture
def tls_cluster(pki):
    """A scheduler and two workers on 127.0.0.1 that speak only mutual TLS."""
    from distributed import LocalCluster
    from distributed.security import Security

    cert, key = pki.server
    sec = Security(tls_ca_file=str(pki.ca), tls_scheduler_cert=str(cert),
                   tls_scheduler_key=str(key), tls_worker_cert=str(cert), tls_worker_key=str(key),
                   tls_client_cert=str(cert), tls_client_key=str(key), require_encryption=True)
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, protocol="tls://",
                           host="127.0.0.1", security=sec, resources={"GPU": 1},
                           dashboard_address=None, silence_logs=logging.CRITICAL)
    try:
        yield cluster
    finally:
        cluster.close()


def _square(x):
    return x * x


def test_tls_scheduler_runs_work_for_a_certified_client_and_refuses_others(pki, tls_cluster):
    from distributed import Client
    from distributed.security import Security

    from rpeg.runtime.dask.driver import DaskCluster

    address = tls_cluster.scheduler_address
    assert address.startswith("tls://127.0.0.1:")
    tls = TlsFiles.resolve(ca=str(pki.ca), cert=str(pki.client[0]), key=str(pki.client[1]),
                           env={})
    check_scheduler_address(address, tls)

    # the way `rpeg run --scheduler tls://... --tls-*` connects: Dask config set from the flags
    with dask_tls(tls), DaskCluster(2, address) as cl:
        assert len(cl.device_workers(2)) == 2
        assert all(a.startswith("tls://") for a in cl.device_workers(2).values())
        futs = cl.client.map(_square, range(8), resources={"GPU": 1})
        assert cl.client.gather(futs) == [x * x for x in range(8)]
    with Client(address, security=security(tls), timeout=10) as c:
        assert c.submit(_square, 7).result() == 49

    # a client with no certificate: the TLS handshake itself is refused by the scheduler
    with pytest.raises((ssl.SSLError, ConnectionError, EOFError)):
        _talk_tls_without_certificate(address, pki.ca)
    # a certificate signed by another CA
    rogue = Security(tls_ca_file=str(pki.ca), tls_client_cert=str(pki.rogue_client[0]),
                     tls_client_key=str(pki.rogue_client[1]), require_encryption=True)
    with pytest.raises((OSError, TimeoutError)):
        with Client(address, security=rogue, timeout=2):
            pytest.fail("a client with a certificate from another CA was let in")
    # plain TCP to the TLS port
    with pytest.raises((OSError, TimeoutError)):
        with Client("tcp://" + address.split("://")[1], timeout=2):
            pytest.fail("a plain-TCP client was let in")


def _talk_tls_without_certificate(address: str, ca: Path) -> None:
    """Open TLS to the scheduler trusting its CA but presenting no certificate, and read."""
    host, port = address.split("://")[1].rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.check_hostname = False
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as s:
            s.sendall(b"\x00" * 16)
            if s.recv(1) == b"":            # TLS 1.3: the refusal arrives as a closed stream
                raise EOFError("the scheduler closed the connection")


def test_tls_flags_are_checked(pki, tmp_path):
    with pytest.raises(RuntimeFailure, match="--tls-key"):
        TlsFiles.resolve(ca=str(pki.ca), cert=str(pki.client[0]), env={})
    assert TlsFiles.resolve(env={}) is None
    env = {"RPEG_TLS_CA": str(pki.ca), "RPEG_TLS_CERT": str(pki.client[0]),
           "RPEG_TLS_KEY": str(pki.client[1])}
    assert TlsFiles.resolve(env=env).key == str(pki.client[1])
    with pytest.raises(RuntimeFailure, match="must exist"):
        TlsFiles.resolve(ca=str(tmp_path / "nope.pem"), cert=str(pki.client[0]),
                         key=str(pki.client[1]), env={})
    with pytest.raises(RuntimeFailure, match="PEM"):         # a key where the CA should be
        TlsFiles.resolve(ca=str(pki.client[1]), cert=str(pki.client[0]),
                         key=str(pki.client[1]), env={})
    loose = tmp_path / "loose.key"
    loose.write_bytes(pki.client[1].read_bytes())
    loose.chmod(0o644)
    with pytest.raises(RuntimeFailure, match="owner only"):
        TlsFiles.resolve(ca=str(pki.ca), cert=str(pki.client[0]), key=str(loose), env={})
    tls = TlsFiles.resolve(ca=str(pki.ca), cert=str(pki.client[0]), key=str(pki.client[1]),
                           env={})
    with pytest.raises(RuntimeFailure, match="tls://"):
        check_scheduler_address("tcp://10.1.2.3:8786", tls)
    with pytest.raises(RuntimeFailure, match="needs --tls-ca"):
        check_scheduler_address("tls://10.1.2.3:8786", None)
    with pytest.raises(RuntimeFailure, match="embedded"):
        check_scheduler_address(None, tls)


# --- nothing read from disk is unpickled ---------------------------------------------------

_UNSAFE = [
    (r"\bimport pickle\b|\bfrom pickle\b|\bpickle\.loads?\(", "pickle"),
    (r"\bcloudpickle\.loads?\(|\bimport cloudpickle\b", "cloudpickle"),
    (r"\bdill\b", "dill"),
    (r"\bjoblib\.load\(", "joblib.load"),
    (r"\bshelve\b", "shelve"),
    (r"\bmarshal\.loads?\(", "marshal"),
    (r"np\.load\([^)]*allow_pickle\s*=\s*True", "np.load(allow_pickle=True)"),
    (r"yaml\.load\((?![^)]*SafeLoader)", "yaml.load without SafeLoader"),
    (r"(?<![.\w])(eval|exec)\(", "eval/exec"),
]


def _sources():
    for folder in ("rpeg", "backends"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_code_path_unpickles_or_evaluates_what_it_reads():
    found = []
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        for pattern, what in _UNSAFE:
            for m in re.finditer(pattern, text):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{path.relative_to(ROOT)}:{line}: {what}")
        for m in re.finditer(r"torch\.load\(([^()]|\([^()]*\))*\)", text):
            if "weights_only=True" not in m.group(0):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{path.relative_to(ROOT)}:{line}: torch.load without "
                             "weights_only=True")
    assert not found, "\n".join(found)


def test_a_pickle_posing_as_a_plan_is_refused_not_run(tmp_path):
    """A plan.json that is really a pickle which would run code: refused as not JSON."""
    import pickle

    from rpeg.errors import PlanError
    from rpeg.plan.model import Plan

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    plan = tmp_path / "plan.json"
    plan.write_bytes(pickle.dumps(Evil(), protocol=0))
    with pytest.raises(PlanError):
        Plan.load(plan)
    plan.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(PlanError):
        Plan.load(plan)
    assert not marker.exists()


def test_rpeg_run_checks_tls_flags_before_starting_anything(pki, tmp_path, capsys):
    from rpeg.cli import main

    spec = ROOT / "pipelines" / "tiny_ppo.rpeg"
    assert main(["run", str(spec), "--tls-ca", str(pki.ca), "--no-progress"]) == 1
    assert "--tls-cert, --tls-key must be given too" in capsys.readouterr().err
    assert main(["run", str(spec), "--scheduler", "tls://127.0.0.1:1", "--no-progress"]) == 1
    assert "needs --tls-ca" in capsys.readouterr().err
    assert main(["run", str(spec), "--scheduler", "tcp://127.0.0.1:1", "--tls-ca", str(pki.ca),
                 "--tls-cert", str(pki.client[0]), "--tls-key", str(pki.client[1]),
                 "--no-progress"]) == 1
    assert "must start with tls://" in capsys.readouterr().err


def test_a_tls_block_keeps_the_dask_defaults_a_first_import_of_distributed_brings():
    """``rpeg run --scheduler tls://...`` checks the scheduler inside ``dask_tls`` before
    anything imported ``distributed``: the block's exit must not drop distributed's
    defaults (the next Client failed with KeyError 'client'). A fresh process, where
    ``distributed`` is not imported yet."""
    import subprocess
    import sys
    code = ("import dask\nfrom rpeg.runtime.dask.security import TlsFiles, dask_tls\n"
            "with dask_tls(TlsFiles('ca.pem', 'c.pem', 'c.key')):\n    pass\n"
            "print(dask.config.get('distributed.client.direct-to-workers', 'MISSING'))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() != "MISSING", done.stdout + done.stderr
