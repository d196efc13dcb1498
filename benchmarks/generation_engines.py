"""The parts of benchmarks/generation.py that measure what a plan chooses for generation:
decode speed at several concurrencies and lengths (torch engine vs vLLM), and the weight
sync into a running vLLM engine (through collectives vs the numpy buckets through Dask),
each with the cost model's prediction beside it.

    .venv-vllm/bin/python benchmarks/generation.py --only concurrency   # ~10 min here
    .venv-vllm/bin/python benchmarks/generation.py --only sync          # SmolLM2-135M, ~5 min

**Concurrency**: ``--concurrency`` sequences decode at once (the batch), each exactly
``--lengths`` tokens (no EOS), prompts of 32 tokens; the torch engine in this process,
vLLM in a Dask worker (timed inside it), one core each; median of ``--repeats``. Time
is the CPU time of the call (the torch engine's thread, the vLLM worker's process): on a
machine whose cores other work shares, that is the engine's busy time, which is what
the cost model predicts; the wall time is recorded beside it. One more row per
engine decodes the largest batch with ``max_seqs`` a quarter of it: the torch engine in
waves, vLLM with ``max_num_seqs`` (continuous batching). Predicted: ``rpeg.cost``'s
generate op on the calibrated CPU profile (``pipelines/clusters/local_cpu.rpeg``) for the
same batch, lengths and rows.

**Weight sync**: SmolLM2-135M, the trainer in one Dask worker (device 0), the vLLM engine
in another (device 1), as ``rpeg run`` places a disaggregated engine. New path
(``backends.vllm_backend.sync``): the trainer's rank 0 broadcasts the weights in its
parameter dtype (float32, and bfloat16) in 64 MB buckets through a gloo group the
engine's worker joined; the engine loads them in place. Old path (the runtime's before):
the trainer exports float32 numpy buckets of 32 MB (:func:`export_buckets`), Dask moves
them to the engine's worker, which loads them into a torch copy of the model
(:func:`load_buckets`) and pushes that copy into the engine in memory. Wall time from
submitting to done, median of ``--repeats`` updates after a first one (which opens the
group). Predicted: ``rpeg.cost.engine_sync.collective_sync_time`` (new) and
``rpeg.cost.stages.weight_sync_time`` (old) on the local CPU cluster, whose link is the
calibrated gloo all-reduce over 127.0.0.1.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import attrs
import numpy as np

from backends.api import SamplingParams
from rpeg.graph.work import work_of  # noqa: E402

PROMPT_LEN = 32
NO_EOS = -1
ROOT = Path(__file__).resolve().parents[1]


def _cluster():
    from rpeg.spec import load_cluster
    return load_cluster(ROOT / "pipelines" / "clusters" / "local_cpu.rpeg")


def _prompts(batch: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, PROMPT_LEN).astype(np.int64) for _ in range(batch)]


# --- concurrency ---------------------------------------------------------------------------

def predict_generate(name: str, engine, batch: int, gen: int, rows: int | None) -> float:
    """Seconds ``rpeg.cost`` predicts for one generate op of ``batch`` x ``gen`` tokens."""
    from rpeg.cost.examples import ppo_pipeline
    from rpeg.cost.stages import estimate_stage
    from rpeg.graph.layout import Layout
    from rpeg.spec.presets import PRESETS
    p = ppo_pipeline(dims=PRESETS[name], prompts=batch, prompt_len=PROMPT_LEN, gen_median=gen,
                     gen_max=gen)
    return estimate_stage(work_of(p, "rollout"), Layout(), (0,), _cluster(), engine=engine,
                          rows=rows).time_s


def measure_concurrency(name: str, args, client, workdir: Path) -> dict:
    from backends.torch_backend.generation import TorchEngine
    from backends.vllm_backend import EngineHost, VllmOptions
    from benchmarks.generation import policy
    from rpeg.spec.model import Engine

    model, path, _ = policy(name, workdir)
    torch_engine = TorchEngine(model)
    top = max(args.concurrency)
    capped = max(top // 4, 1)
    rows = []
    for seqs in (None, capped):              # all at once, then a quarter at a time
        options = VllmOptions(dtype="float32", max_model_len=PROMPT_LEN + max(args.lengths) + 8,
                              cpu_cores="0", kv_cache_gib=1, max_num_seqs=seqs)
        host = EngineHost.start(client, path, options)
        try:
            cases = [(c, n) for c in args.concurrency for n in args.lengths] if seqs is None \
                else [(top, n) for n in args.lengths]
            host.actor.timed_generate(_prompts(2), SamplingParams(4, eos_id=NO_EOS)).result()
            for batch, gen in cases:
                for engine in (Engine.TORCH, Engine.VLLM):
                    walls, cpus = [], []
                    for rep in range(args.repeats):
                        params = SamplingParams(gen, eos_id=NO_EOS, seed=rep,
                                                max_num_seqs=seqs or 0)
                        ps = _prompts(batch, seed=rep)
                        if engine is Engine.VLLM:
                            wall, _, cpu = host.actor.timed_generate(ps, params).result()
                        else:
                            t0, c0 = time.perf_counter(), time.thread_time()
                            list(torch_engine.generate(ps, params))
                            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
                        walls.append(wall)
                        cpus.append(cpu)
                    seconds = statistics.median(cpus)
                    predicted = predict_generate(name, engine, batch, gen, seqs)
                    rows.append({"engine": engine.value, "batch": batch, "gen": gen,
                                 "max_seqs": seqs or batch, "seconds": seconds,
                                 "tokens_per_s": batch * gen / seconds,
                                 "wall_s": statistics.median(walls),
                                 "predicted_s": predicted,
                                 "predicted_tokens_per_s": batch * gen / predicted,
                                 "cpu_runs": cpus, "wall_runs": walls})
                    print(f"  {engine.value:5s} batch {batch:3d} x {gen:3d} (max_seqs "
                          f"{seqs or batch}): {batch * gen / seconds:7.0f} tok/s, predicted "
                          f"{batch * gen / predicted:7.0f}", flush=True)
        finally:
            host.shutdown()
    return {"model": name, "rows": rows}


# --- weight sync ---------------------------------------------------------------------------

_HELD: dict = {}          # per worker: the trainer's model, or the engine and its torch copy


def _trainer_setup(path: str, dtype: str) -> int:
    import torch

    from backends.torch_backend.modeling import build_model
    from rpeg.spec.presets import PRESETS
    torch.set_num_threads(1)
    model = _HELD.get("model")
    if model is None:
        model = _HELD["model"] = build_model(PRESETS["smollm2-135m"], heads=("lm", "value"),
                                             weights=path)
    for p in model.parameters():
        p.data = p.data.to(getattr(torch, dtype))
    return sum(p.numel() for p in model.parameters())


def _engine_setup(path: str) -> float:
    from backends.torch_backend.modeling import build_model
    from backends.vllm_backend.engine import VllmEngine, VllmOptions
    from rpeg.spec.presets import PRESETS
    t0 = time.perf_counter()
    _HELD["engine"] = VllmEngine.start(path, VllmOptions(dtype="float32", max_model_len=256,
                                                         cpu_cores="nobind", kv_cache_gib=1))
    _HELD["copy"] = build_model(PRESETS["smollm2-135m"], heads=("lm", "value"), weights=path)
    return time.perf_counter() - t0


def _send(addr: str) -> tuple[int, int]:
    from backends.vllm_backend import sync
    if _HELD.get("addr") != addr:
        _HELD["group"], _HELD["addr"] = sync.open_group(addr, 0, 2), addr
    return sync.send(_HELD["group"], _HELD["model"].state_dict(), sync_bucket())


def _receive(addr: str, version: int) -> int:
    return _HELD["engine"].receive_weights(addr, 1, 2, version).bytes


OLD_BUCKET_BYTES = 32 << 20     # the old path's numpy buckets


def export_buckets(model, bucket_bytes: int = OLD_BUCKET_BYTES) -> list[tuple]:
    """The old path's export: ``model``'s weights, whole, as float32 numpy buckets of about
    ``bucket_bytes`` (``(names, shapes, flat array)`` each), cut as a transfer cuts them
    (``backends.torch_backend.weights``)."""
    import torch

    from backends.torch_backend.weights import bucket_plan, named_weights, whole
    weights = dict(named_weights(model))
    shapes = [(k, tuple(v.shape)) for k, v in weights.items()]
    out = []
    for bucket in bucket_plan(shapes, 4, bucket_bytes):
        flat = np.concatenate([whole(weights[k]).detach().to("cpu", torch.float32).numpy()
                               .ravel() for k, _ in bucket])
        out.append((tuple(k for k, _ in bucket), tuple(s for _, s in bucket), flat))
    return out


def load_buckets(model, buckets: list[tuple]) -> None:
    """The old path's load: :func:`export_buckets`' buckets into ``model``
    (``backends.torch_backend.distributed.load_full``)."""
    import torch

    from backends.torch_backend.distributed import load_full

    def tensors():
        for names, shapes, flat in buckets:
            off = 0
            for name, shape in zip(names, shapes, strict=True):
                n = int(np.prod(shape, dtype=np.int64))
                yield name, torch.from_numpy(flat[off:off + n].reshape(shape))
                off += n
    load_full(model, tensors())


def _export_old() -> list:
    return export_buckets(_HELD["model"])


def _load_old(buckets: list, version: int) -> int:
    load_buckets(_HELD["copy"], buckets)
    _HELD["engine"].update_weights(_HELD["copy"].state_dict().items(), version)
    return sum(int(flat.nbytes) for _, _, flat in buckets)


def _shutdown() -> None:
    engine = _HELD.pop("engine", None)
    if engine is not None:
        engine.shutdown()
    _HELD.clear()


def sync_bucket() -> int:
    from backends.vllm_backend.weights import DEFAULT_BUCKET_BYTES
    return DEFAULT_BUCKET_BYTES


def predict_sync(path: str, dtype: str) -> float:
    from rpeg.cost.engine_sync import collective_sync_time
    from rpeg.cost.stages import weight_sync_time
    from rpeg.graph.layout import Layout
    from rpeg.spec.model import Model
    from rpeg.spec.presets import PRESETS
    cluster = _cluster()
    nbytes = {"float32": 4.0, "bfloat16": 2.0}[dtype]
    cluster = attrs.evolve(cluster, gpu=attrs.evolve(cluster.gpu, compute_bytes=nbytes))
    model = Model("actor", "smollm2-135m", PRESETS["smollm2-135m"])
    if path == "old":
        return weight_sync_time(model, (0,), Layout(), (1,), Layout(), cluster)
    return collective_sync_time(model, (0,), Layout(), ((1,),), cluster)


def measure_sync(args, client) -> dict:
    from backends.torch_backend.measure_devices import _free_port
    from backends.vllm_backend.models import smollm2_dir

    path = str(smollm2_dir())
    trainer, engine = sorted(client.scheduler_info()["workers"])[:2]

    def on(worker, fn, *a):
        return client.submit(fn, *a, workers=[worker], pure=False, allow_other_workers=False)

    startup = on(engine, _engine_setup, path).result()
    out = {"model": "smollm2-135m", "engine_startup_s": startup, "paths": []}
    version = 0
    try:
        for label, dtype in (("collectives", "float32"), ("collectives", "bfloat16"),
                             ("numpy via Dask", "float32")):
            params = on(trainer, _trainer_setup, path, dtype).result()
            addr = f"tcp://127.0.0.1:{_free_port()}"
            walls, nbytes = [], 0
            for rep in range(args.repeats + 1):
                version += 1
                t0 = time.perf_counter()
                if label == "collectives":
                    got = on(engine, _receive, addr, version)
                    sent = on(trainer, _send, addr)
                    nbytes = sent.result()[1]
                    assert got.result() == nbytes
                else:
                    nbytes = on(engine, _load_old, on(trainer, _export_old), version).result()
                if rep:                        # the first opens the group / warms caches
                    walls.append(time.perf_counter() - t0)
            predicted = predict_sync("new" if label == "collectives" else "old", dtype)
            row = {"path": label, "dtype": dtype, "params": params, "bytes": nbytes,
                   "median_s": statistics.median(walls), "runs": walls,
                   "gb_per_s": nbytes / statistics.median(walls) / 1e9,
                   "predicted_s": predicted}
            out["paths"].append(row)
            print(f"  {label:15s} {dtype:8s}: {nbytes / 1e6:6.0f} MB in "
                  f"{row['median_s']:.2f} s (predicted {predicted:.2f} s)", flush=True)
    finally:
        on(engine, _shutdown).result()
    return out


# --- report --------------------------------------------------------------------------------

def concurrency_markdown(doc: dict) -> list[str]:
    c = doc.get("concurrency")
    if not c:
        return []
    lines = ["", "## Decode speed by concurrency and length", "",
             f"Command: `{c['command']}` (load {c['load'][0]:.1f} at the start, {c['load'][1]:.1f} "
             f"at the end). Tokens per CPU-second of one generate call (one core per engine); "
             f"predicted by rpeg.cost on the local CPU profile.", "",
             "| model | sequences | max at once | tokens each | torch tok/s (pred.) | "
             "vLLM tok/s (pred.) | vLLM / torch |", "|---|---:|---:|---:|---:|---:|---:|"]
    for res in c["models"]:
        by = {(r["engine"], r["batch"], r["gen"], r["max_seqs"]): r for r in res["rows"]}
        for (engine, b, g, m), r in by.items():
            if engine != "torch":
                continue
            v = by[("vllm", b, g, m)]
            lines.append(f"| {res['model']} | {b} | {m} | {g} | {r['tokens_per_s']:.0f} "
                         f"({r['predicted_tokens_per_s']:.0f}) | {v['tokens_per_s']:.0f} "
                         f"({v['predicted_tokens_per_s']:.0f}) | "
                         f"{v['tokens_per_s'] / r['tokens_per_s']:.2f}x |")
    lines += ["", "Prediction error over these calls (MAPE, max): " + "; ".join(
        f"{e} {np.mean(x):.0%}, {np.max(x):.0%}" for e, x in _errors(c).items()) + "."]
    return lines


def _errors(c: dict) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for res in c["models"]:
        for r in res["rows"]:
            out.setdefault(r["engine"], []).append(abs(r["predicted_s"] - r["seconds"])
                                                   / r["seconds"])
    return out


def sync_markdown(doc: dict) -> list[str]:
    s = doc.get("sync")
    if not s:
        return []
    lines = ["", "## Weight sync into a running vLLM engine (SmolLM2-135M)", "",
             f"Command: `{s['command']}` (load {s['load'][0]:.1f} at the start, "
             f"{s['load'][1]:.1f} at the end). Trainer on device 0, engine on device 1 "
             f"(separate Dask workers); median of {len(s['paths'][0]['runs'])} updates.", "",
             "| path | dtype | bytes | time | GB/s | predicted |", "|---|---|---:|---:|---:|---:|"]
    for r in s["paths"]:
        lines.append(f"| {r['path']} | {r['dtype']} | {r['bytes'] / 1e6:.0f} MB | "
                     f"{r['median_s']:.2f} s | {r['gb_per_s']:.2f} | {r['predicted_s']:.2f} s |")
    return lines
