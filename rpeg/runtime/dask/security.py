"""Who may talk to a run: the embedded cluster on loopback, and TLS with mutual authentication
for a remote scheduler.

    >>> tls = TlsFiles.resolve(ca="certs/ca.pem", cert="certs/me.pem", key="certs/me.key")  # doctest: +SKIP
    >>> with dask_tls(tls):                     # every Client made inside speaks TLS
    ...     run(pipeline, plan, RunOptions(scheduler="tls://10.0.0.5:8786"))            # doctest: +SKIP

The embedded default (no ``--scheduler``) starts a ``LocalCluster`` whose
scheduler, workers and nannies listen on 127.0.0.1 only, with no dashboard: no
other machine can reach it. A remote scheduler is reached over ``tls://``
with a CA, a certificate and a key — from ``--tls-ca/--tls-cert/--tls-key``,
the environment (``RPEG_TLS_CA``, ``RPEG_TLS_CERT``, ``RPEG_TLS_KEY``) or
Dask's own configuration (``distributed.comm.tls.*``). Encryption is then
required: the scheduler must present a certificate the CA signed, and so must
this client (the scheduler started with ``--tls-ca-file ... --tls-cert ...
--tls-key ...`` refuses a client without one).

Nothing here imports torch; the only Dask import is inside :func:`security`.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path

import attrs

from rpeg.errors import RuntimeFailure, Span

ENV = {"ca": "RPEG_TLS_CA", "cert": "RPEG_TLS_CERT", "key": "RPEG_TLS_KEY"}
MAX_PEM_BYTES = 1 << 20


@attrs.frozen
class TlsFiles:
    """The three files of mutual TLS: the CA that signs every party, and this client's pair."""

    ca: str
    cert: str
    key: str

    @classmethod
    def resolve(cls, ca: str | None = None, cert: str | None = None, key: str | None = None,
                env: Mapping[str, str] | None = None) -> TlsFiles | None:
        """Flags first, then the environment; None when neither names any file.

        Either all three are given or none: a CA without a client pair cannot authenticate
        this side, and is refused with a message rather than silently run in the clear.
        """
        env = os.environ if env is None else env
        given = {"ca": ca or env.get(ENV["ca"]) or None,
                 "cert": cert or env.get(ENV["cert"]) or None,
                 "key": key or env.get(ENV["key"]) or None}
        if not any(given.values()):
            return None
        missing = [k for k, v in given.items() if not v]
        if missing:
            flags = ", ".join(f"--tls-{k}" for k in missing)
            raise RuntimeFailure(f"TLS needs a CA, a certificate and a key; {flags} must be "
                                 "given too", hint="pass all three (or set RPEG_TLS_CA, "
                                 "RPEG_TLS_CERT, RPEG_TLS_KEY)")
        files = cls(**{k: str(Path(v).expanduser()) for k, v in given.items()})
        files.check()
        return files

    def check(self) -> None:
        """Each file must be a readable PEM file; the key must not be readable by others."""
        for what, path, marker in (("CA", self.ca, b"CERTIFICATE"),
                                   ("certificate", self.cert, b"CERTIFICATE"),
                                   ("key", self.key, b"PRIVATE KEY")):
            p = Path(path)
            where = Span(path, 0, 0)
            try:
                st = p.stat()
            except OSError as e:
                raise RuntimeFailure(f"TLS {what} file '{path}' must exist, and it does not "
                                     f"({e.strerror})", where) from None
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_PEM_BYTES:
                raise RuntimeFailure(f"TLS {what} file '{path}' must be a PEM file of at most "
                                     f"{MAX_PEM_BYTES:,} bytes", where)
            head = p.read_bytes()
            if b"-----BEGIN" not in head or marker not in head:
                raise RuntimeFailure(f"TLS {what} file '{path}' must hold a PEM "
                                     f"{marker.decode().lower()}, and it does not", where,
                                     hint="PEM files start with '-----BEGIN ...-----'")
            if what == "key" and st.st_mode & 0o077:
                raise RuntimeFailure(f"TLS key file '{path}' must be readable by its owner only, "
                                     f"not mode {stat.S_IMODE(st.st_mode):o}", where,
                                     hint=f"chmod 600 {path}")


def security(tls: TlsFiles):
    """Dask's ``Security`` for a client: verify the scheduler against the CA, present our pair,
    and refuse any unencrypted connection."""
    from distributed.security import Security
    return Security(tls_ca_file=tls.ca, tls_client_cert=tls.cert, tls_client_key=tls.key,
                    require_encryption=True)


def dask_config(tls: TlsFiles) -> dict[str, object]:
    """The same as Dask configuration keys: a ``Client()`` made with no ``security`` reads them."""
    return {"distributed.comm.tls.ca-file": tls.ca,
            "distributed.comm.tls.client.cert": tls.cert,
            "distributed.comm.tls.client.key": tls.key,
            "distributed.comm.require-encryption": True}


@contextlib.contextmanager
def dask_tls(tls: TlsFiles | None) -> Iterator[None]:
    """Within the block, every Dask client speaks mutual TLS (a no-op for ``None``)."""
    if tls is None:
        yield
        return
    import dask
    import distributed  # noqa: F401 — its defaults join dask's config before the block: a
    # first import inside it would lose them when the block restores the config
    with dask.config.set(dask_config(tls)):
        yield


def check_scheduler_address(address: str | None, tls: TlsFiles | None) -> None:
    """``tls://`` and TLS files go together: no certificate is sent over plain TCP."""
    if address is None:
        if tls is not None:
            raise RuntimeFailure("--tls-* files are for a remote --scheduler; the embedded "
                                 "cluster listens on 127.0.0.1 only and needs none")
        return
    scheme = address.split("://", 1)[0] if "://" in address else "tcp"
    if tls is not None and scheme != "tls":
        raise RuntimeFailure(f"with TLS files the scheduler address must start with tls://, "
                             f"not {scheme}://", hint=f"use tls://{address.split('://')[-1]}")
    if tls is None and scheme == "tls":
        raise RuntimeFailure("a tls:// scheduler needs --tls-ca, --tls-cert and --tls-key",
                             hint="or set RPEG_TLS_CA, RPEG_TLS_CERT and RPEG_TLS_KEY")


def listening_addresses(client) -> dict[str, str]:
    """Every address the cluster behind ``client`` listens on: scheduler, workers, nannies."""
    info = client.scheduler_info(n_workers=-1)
    out = {"scheduler": info["address"]}
    for addr, w in info["workers"].items():
        out[f"worker {w.get('name', addr)}"] = addr
        if w.get("nanny"):
            out[f"nanny {w.get('name', addr)}"] = w["nanny"]
    return out


def host_of(address: str) -> str:
    hostport = address.split("://", 1)[-1]
    return hostport.rsplit(":", 1)[0].strip("[]")
