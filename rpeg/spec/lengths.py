"""Lengths as a spec writes them: a count (tokens, turns) or a distribution of counts
(``fixed``, ``uniform``, ``lognormal``, or ``empirical`` from a histogram file), for the
workload's ``prompt_len`` and ``gen_len`` and for a generate stage's ``turns`` and
``obs_len``."""

from __future__ import annotations

from pathlib import Path

from rpeg.errors import Span, SpecError, did_you_mean
from rpeg.spec import ast
from rpeg.spec import values as V
from rpeg.spec.keys import DISTRIBUTIONS, MAX_TOKENS, distribution
from rpeg.spec.model import LengthDist, LengthKind, lognormal_sigma
from rpeg.spec.paths import resolve_written

MAX_HISTOGRAM_BYTES = 64 * 1024 * 1024


def length(v: ast.Value, key: str = "gen_len") -> LengthDist:
    """A count (tokens, turns) or a distribution of counts, as ``gen_len`` is written."""
    if isinstance(v, ast.Number):
        return LengthDist.fixed(V.integer(v, key, minimum=1, maximum=MAX_TOKENS))
    if not isinstance(v, ast.Call):
        raise SpecError(f"{key} must be a length or a distribution such as "
                        f"lognormal(median = 512, max = 2048), not {V.kind_of(v)}", v.span)
    fn = v.func.value
    kinds = tuple(d.name for d in DISTRIBUTIONS)
    if fn not in kinds:
        raise SpecError(f"{key} distribution must be one of {', '.join(kinds)}, not '{fn}'",
                        v.func.span, hint=did_you_mean(fn, kinds))
    kw = {k.key.value: k for k in v.kwargs}

    def arg(key: str, pos: int | None = None) -> ast.Value | None:
        if key in kw:
            return kw[key].value
        if pos is not None and pos < len(v.args):
            return v.args[pos]
        return None

    def need(key: str, pos: int | None = None) -> ast.Value:
        x = arg(key, pos)
        if x is None:
            raise SpecError(f"{fn}(...) needs {key} = ...", v.span)
        return x

    allowed = distribution(fn).keys
    for k in v.kwargs:
        if k.key.value not in allowed:
            raise V.unknown_key(k.key, allowed, f"{fn}(...)")
    if fn == "fixed":
        return LengthDist.fixed(V.integer(need("n", 0), key, minimum=1, maximum=MAX_TOKENS))
    if fn == "uniform":
        lo = V.integer(need("min", 0), "min", minimum=1, maximum=MAX_TOKENS)
        hi = V.integer(need("max", 1), "max", minimum=1, maximum=MAX_TOKENS)
        if hi < lo:
            raise SpecError(f"uniform max must be at least min ({lo}), not {hi}", v.span)
        return LengthDist(LengthKind.UNIFORM, max_len=hi, low=lo)
    if fn == "lognormal":
        median = V.real(need("median", 0), "median", positive=True, maximum=MAX_TOKENS)
        hi = V.integer(need("max", 1), "max", minimum=1, maximum=MAX_TOKENS)
        if hi < median:
            raise SpecError(f"lognormal max must be at least the median ({median:g}), not {hi}",
                            v.span)
        sv = arg("sigma", 2)
        sigma = V.real(sv, "sigma", minimum=0.0, maximum=10.0) if sv is not None \
            else lognormal_sigma(median, hi)
        return LengthDist(LengthKind.LOGNORMAL, max_len=hi, median=median, sigma=sigma)
    src = v.args[0] if v.args else None
    if src is None:
        raise SpecError('empirical(...) needs a histogram file: empirical("lengths.csv")', v.span)
    file = V.string(src, "empirical histogram")
    bins = _histogram(resolve_written(file, src.span), src.span)
    mv = arg("max")
    hi = V.integer(mv, "max", minimum=1, maximum=MAX_TOKENS) if mv is not None else \
        max(b[0] for b in bins)
    return LengthDist(LengthKind.EMPIRICAL, max_len=hi, bins=bins, source=file)


def _histogram(file: Path, span: Span) -> tuple[tuple[int, float], ...]:
    """A histogram file: one 'length,weight' (or 'length weight') pair per line; '#' comments."""
    try:
        if not file.is_file():        # a pipe or device would block or never end
            raise OSError("not a regular file")
        if file.stat().st_size > MAX_HISTOGRAM_BYTES:
            raise SpecError(f"histogram file '{file}' is {file.stat().st_size:,} bytes; at most "
                            f"{MAX_HISTOGRAM_BYTES:,}", span,
                            hint="a histogram has one line per distinct length")
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        raise SpecError(f"cannot read histogram file '{file}'", span,
                        hint="one 'length,weight' pair per line") from None
    bins = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line or line.lower().startswith("length"):
            continue
        parts = line.replace(",", " ").split()
        try:
            length, weight = int(parts[0]), float(parts[1]) if len(parts) > 1 else 1.0
        except (ValueError, IndexError):
            raise SpecError(f"{file}:{n}: histogram lines must be 'length,weight', not "
                            f"{line!r}", span) from None
        if length < 1 or length > MAX_TOKENS or not (0 <= weight < float("inf")):
            raise SpecError(f"{file}:{n}: length must be 1..{MAX_TOKENS} and weight >= 0",
                            span)
        bins.append((length, weight))
    if not bins or sum(w for _, w in bins) <= 0:
        raise SpecError(f"histogram file '{file}' has no positive weights", span)
    return tuple(bins)
