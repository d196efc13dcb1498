"""Fixtures for the reliability tests: certificates made in the test (a CA, and parties it
signs, for 127.0.0.1 and localhost).

    >>> ca = make_ca(tmp_path, "rpeg-test-ca")                        # doctest: +SKIP
    >>> cert, key = issue(ca, tmp_path, "client")                     # doctest: +SKIP
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path

import attrs
import pytest

try:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
except ImportError:            # the TLS tests skip; everything else here runs
    x509 = None


@attrs.frozen
class Ca:
    cert_path: Path
    cert: object                 # x509.Certificate
    key: object                  # the CA's private key


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    os.chmod(path, 0o600)


def make_ca(folder: Path, cn: str) -> Ca:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    path = folder / f"{cn}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Ca(path, cert, key)


def issue(ca: Ca, folder: Path, cn: str) -> tuple[Path, Path]:
    """A certificate (server and client use) for ``cn`` at 127.0.0.1/localhost, signed by ``ca``."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca.cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
                                                  x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca.key, hashes.SHA256()))
    cert_path, key_path = folder / f"{cn}.pem", folder / f"{cn}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, key_path)
    return cert_path, key_path


@attrs.frozen
class Pki:
    """A CA with a scheduler/worker pair and a client pair, and a rogue CA's client pair."""

    ca: Path
    server: tuple[Path, Path]
    client: tuple[Path, Path]
    rogue_client: tuple[Path, Path]


@pytest.fixture
def pki(tmp_path) -> Pki:
    if x509 is None:
        pytest.skip("needs the cryptography package")
    ca = make_ca(tmp_path, "rpeg-test-ca")
    rogue = make_ca(tmp_path, "rogue-ca")
    return Pki(ca.cert_path, issue(ca, tmp_path, "cluster"), issue(ca, tmp_path, "client"),
               issue(rogue, tmp_path, "intruder"))


@pytest.fixture(scope="session")
def micro_run(tmp_path_factory) -> Path:
    """One real run of a small PPO pipeline (tests/reliability/test_faults.py's, 4 steps,
    checkpoints at steps 2 and 4, split over 2 Dask workers), made once per session and
    verified; tests copy it before they damage it."""
    from rpeg.cli import main
    from rpeg.runtime import RunOptions
    from rpeg.runtime.dask.runner import Resilience, run_resilient
    from rpeg.runtime.placement import split_plan
    from rpeg.spec import load
    from tests.reliability.test_faults import micro_spec
    from tests.reliability.test_hostile_input import no_hang

    spec = micro_spec(tmp_path_factory.mktemp("micro"))
    pipeline = load(spec)
    run_dir = tmp_path_factory.mktemp("made") / "run"
    with no_hang(900):
        run_resilient(pipeline, split_plan(pipeline, 2, staleness=1),
                      RunOptions(steps=4, run_dir=str(run_dir), progress=False),
                      spec_path=str(spec), resilience=Resilience(checkpoint_every=2))
    assert main(["verify", str(run_dir)]) == 0
    return run_dir


@pytest.fixture
def run(micro_run, tmp_path) -> Path:
    """A copy of the session's real run to damage."""
    import shutil
    dst = tmp_path / "run"
    shutil.copytree(micro_run, dst)
    return dst
