"""The vLLM engine inside the Dask worker that owns the device.

    >>> import dask
    >>> from distributed import Client, LocalCluster
    >>> with dask.config.set(vllm_dask_config()):                              # doctest: +SKIP
    ...     cluster = LocalCluster(n_workers=2, threads_per_worker=1, resources={"GPU": 1})
    >>> client = Client(cluster)                                                # doctest: +SKIP
    >>> host = EngineHost.start(client, "ckpt/tiny", VllmOptions(dtype="float32"), worker=addr)  # doctest: +SKIP
    >>> for chunk in host.generate(prompts, SamplingParams(max_new_tokens=32), chunks=2):   # doctest: +SKIP
    ...     downstream(chunk)                          # while the rest still generates
    >>> push_weights(host.actor, model.state_dict().items(), version=1)       # doctest: +SKIP
    >>> host.shutdown()                                # before the cluster closes   # doctest: +SKIP

The engine is a Dask actor: its methods run one at a time on the worker
that holds it, so generation and weight loads never interleave. A generate
call streams: the caller asks for one finished chunk at a time while the
engine keeps decoding the longer responses. ``push_weights`` may run in the
trainer's own worker (pass it the actor): buckets then travel worker to
worker, in memory, one message each.

Two rules from running vLLM under Dask: workers must be non-daemon
(``vllm_dask_config``), since a daemon process cannot start vLLM's children;
and the engine must be shut down inside its worker before the cluster
closes, or those children outlive the cluster.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from backends.api import RolloutChunk, SamplingParams
from backends.vllm_backend.engine import SyncRecord, VllmEngine, VllmOptions
from backends.vllm_backend.weights import DEFAULT_BUCKET_BYTES, buckets
from rpeg.errors import BackendError


def vllm_dask_config() -> dict[str, Any]:
    """Dask settings a cluster that hosts vLLM engines needs (use with ``dask.config.set``)."""
    return {"distributed.worker.daemon": False}


class EngineActor:
    """Holds one :class:`VllmEngine` in a Dask worker; create with ``client.submit(..., actor=True)``."""

    def __init__(self, model_dir: str, options: VllmOptions) -> None:
        self.engine = VllmEngine.start(model_dir, options)
        self._stream: Iterator[RolloutChunk] | None = None

    def version(self) -> int:
        return self.engine.version

    def syncs(self) -> list[SyncRecord]:
        return list(self.engine.syncs)

    def start_generate(self, prompt_ids: list, params: SamplingParams, chunks: int = 1,
                       min_version: int | None = None) -> int:
        """Queue the prompts; returns the version that will serve them."""
        if min_version is not None and self.engine.version < min_version:
            raise BackendError(f"engine must serve parameter version >= {min_version}, "
                               f"not {self.engine.version}",
                               hint="push the trainer's weights before generating at this staleness")
        self._close_stream()
        self._stream = self.engine.generate(prompt_ids, params, chunks)
        return self.engine.version

    def next_chunk(self) -> RolloutChunk | None:
        """The next group of finished responses, or None when the call is complete."""
        if self._stream is None:
            return None
        chunk = next(self._stream, None)
        if chunk is None:
            self._stream = None
        return chunk

    def generate(self, prompt_ids: list, params: SamplingParams, chunks: int = 1,
                 min_version: int | None = None) -> list[RolloutChunk]:
        """All chunks of one call at once (no streaming)."""
        self.start_generate(prompt_ids, params, chunks, min_version)
        return list(iter(self.next_chunk, None))

    def timed_generate(self, prompt_ids: list, params: SamplingParams
                       ) -> tuple[float, int, float]:
        """Seconds one call takes inside the worker (no messaging), the tokens it made, and
        the worker process's CPU seconds meanwhile (its busy time on a shared machine)."""
        import time

        self._close_stream()
        t0, c0 = time.perf_counter(), time.process_time()
        chunks = list(self.engine.generate(prompt_ids, params))
        return (time.perf_counter() - t0, sum(len(r) for c in chunks for r in c.response_ids),
                time.process_time() - c0)

    def begin_update(self) -> None:
        self._close_stream()
        self.engine.begin_update()

    def load_bucket(self, bucket: list[tuple[str, Any]]) -> int:
        return self.engine.load_bucket(bucket)

    def commit(self, version: int) -> SyncRecord:
        return self.engine.commit(version)

    def param_checksum(self, name: str) -> float:
        return self.engine.param_checksum(name)

    def receive_weights(self, addr: str, first_rank: int, world: int, version: int) -> SyncRecord:
        """One update through the trainer's weight-sync group (``backends.vllm_backend.sync``)."""
        self._close_stream()
        return self.engine.receive_weights(addr, first_rank, world, version)

    def shutdown(self) -> None:
        self._close_stream()
        self.engine.shutdown()

    def _close_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()          # aborts the requests still decoding
            self._stream = None


def push_weights(actor: Any, named_tensors: Iterable[tuple[str, Any]], version: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> SyncRecord:
    """Send parameters to an engine actor one bucket per message; it serves ``version`` after.

    ``named_tensors`` are the trainer's (name, tensor) pairs: torch tensors are sent
    as they are (bf16 stays bf16), detached and on CPU.
    """
    actor.begin_update().result()
    for bucket in buckets(named_tensors, bucket_bytes):
        actor.load_bucket([(name, _cpu(t)) for name, t in bucket]).result()
    return actor.commit(version).result()


class EngineHost:
    """A client-side handle on an engine actor: generate (streaming), weights, shutdown."""

    def __init__(self, client: Any, actor: Any, worker: str | None) -> None:
        # Use EngineHost.start.
        self.client = client
        self.actor = actor
        self.worker = worker

    @classmethod
    def start(cls, client: Any, model_dir: str | Path, options: VllmOptions = VllmOptions(),
              worker: str | None = None) -> EngineHost:
        """Start an engine in ``worker`` (an address; any worker when None) and wait until it serves."""
        future = client.submit(EngineActor, str(model_dir), options, actor=True, pure=False,
                               workers=[worker] if worker else None)
        actor = future.result()
        return cls(client, actor, worker or next(iter(client.who_has(future)[future.key]), None))

    @property
    def version(self) -> int:
        return self.actor.version().result()

    def generate(self, prompt_ids: list, params: SamplingParams, chunks: int = 1,
                 min_version: int | None = None) -> Iterator[RolloutChunk]:
        """Yield finished chunks as the engine produces them."""
        self.actor.start_generate(prompt_ids, params, chunks, min_version).result()
        while (chunk := self.actor.next_chunk().result()) is not None:
            yield chunk

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> SyncRecord:
        return push_weights(self.actor, named_tensors, version, bucket_bytes)

    def shutdown(self) -> None:
        """Stop the engine inside its worker (call before closing the cluster)."""
        if self.actor is not None:
            self.actor.shutdown().result()
            self.actor = None

    def __enter__(self) -> EngineHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _cpu(tensor: Any) -> Any:
    if hasattr(tensor, "detach"):
        return tensor.detach().to("cpu").contiguous()
    return tensor
