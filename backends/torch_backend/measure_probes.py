"""Micro-benchmarks of one device: GEMM rates, copy and streaming bandwidth, an optimizer step.

    >>> t = gemm_seconds(256, 256, 256, repeats=3)                  # doctest: +SKIP
    >>> copy_bandwidth() > 1e9                                      # doctest: +SKIP
    True
"""

from __future__ import annotations

import torch

from backends.torch_backend.measure_env import DTYPES, _median_time
from backends.torch_backend.modeling import build_model
from rpeg.spec.presets import ModelDims


def gemm_seconds(m: int, n: int, k: int, dtype: str = "fp32", repeats: int = 5) -> float:
    a = torch.randn(m, k, dtype=DTYPES[dtype])
    b = torch.randn(k, n, dtype=DTYPES[dtype])
    out = torch.empty(m, n, dtype=DTYPES[dtype])
    return _median_time(lambda: torch.mm(a, b, out=out), repeats, min_time=0.05)


def gemm_sweep(shapes, dtype: str = "fp32", repeats: int = 5) -> list[dict]:
    return [{"m": m, "n": n, "k": k, "dtype": dtype, "seconds": gemm_seconds(m, n, k, dtype,
                                                                             repeats)}
            for m, n, k in shapes]


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes per second moved by a large copy (read + write counted)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), repeats)
    return 2 * nbytes / t


def _stream_probe(rows: int = 4, hidden: int = 320, ffn: int = 864, layers: int = 4):
    """Skinny GEMMs over a chain of distinct weights (~20 MB): (run, bytes streamed)."""
    import torch.nn.functional as F
    shapes = [(hidden, hidden)] * 4 + [(ffn, hidden)] * 2 + [(hidden, ffn)]
    ws = [torch.randn(*s) for _ in range(layers) for s in shapes]
    xs = {k: torch.randn(rows, k) for k in (hidden, ffn)}

    def run():
        for w in ws:
            F.linear(xs[w.shape[1]], w)
    return run, sum(w.numel() * 4 for w in ws)


def _copy_probe(nbytes: int = 64 * 2**20):
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * nbytes


BANDWIDTH_PROBES = {"stream": _stream_probe, "copy": _copy_probe}


def stream_bandwidth(repeats: int = 20) -> float:
    """Bytes per second at which skinny GEMMs (decode: a few rows) stream their weights:
    distinct matrices, so they come from beyond the core's cache as a model's layers do."""
    run, nbytes = _stream_probe()
    return nbytes / _median_time(run, repeats)


def probe_bytes(kind: str) -> int:
    return {"stream": lambda: _stream_probe()[1], "copy": lambda: _copy_probe()[1]}[kind]()



def optimizer_seconds(dims: ModelDims, repeats: int = 5) -> dict:
    """AdamW step plus gradient clipping on a model whose gradients are set."""
    from torch import nn
    model = build_model(dims, heads=("lm",), seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-5)

    def step():
        nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    c = _median_time(step, repeats)
    return {"params": sum(p.numel() for p in params), "tensors": len(params), "seconds": c}


__all__ = ["BANDWIDTH_PROBES", "copy_bandwidth", "gemm_seconds", "gemm_sweep",
           "optimizer_seconds", "probe_bytes", "stream_bandwidth"]
