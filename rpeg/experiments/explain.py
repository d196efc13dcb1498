"""What a change is predicted to cost, in one sentence a person reads.

    >>> a = {"step_time_s": 10.0, "peak_memory_per_device": [40e9] * 16 + [20e9] * 16}
    >>> b = {"step_time_s": 8.8, "peak_memory_per_device": [43e9] * 16 + [20e9] * 16}
    >>> cost_sentence(["staleness rollout 1 -> 2"], a, b)
    'staleness rollout 1 -> 2: predicted step time -12%, peak memory +3 GB on GPUs 0-15'
    >>> b["layout"] = {"rollout": [0, 1]}          # stages moved: compare the largest peaks
    >>> cost_sentence(["staleness rollout 1 -> 2"], a, b)
    'staleness rollout 1 -> 2: predicted step time -12%, peak memory +3 GB per GPU at most (40 GB -> 43 GB)'

``rpeg diff A.rpeg B.rpeg --cluster C.rpeg`` prints this line above the table of
predicted figures; ``rpeg diff`` on two run directories prints it for the
predictions recorded with each run. Memory is compared device by device and
reported for the runs of devices whose peak moved by the same amount when the
stages sit on the same devices in both plans (``layout``: stage -> devices), else
as the change of the largest per-GPU peak.
"""

from __future__ import annotations

from rpeg.plan.model import device_ranges

MAX_CHANGES = 2          # changes named in the sentence; the rest are counted
MEMORY_EPS = 0.01        # peak-memory moves below this fraction of the largest peak are noise


def change_words(spec_diff) -> list[str]:
    """Short names of the changes of a SpecDiff: ``staleness rollout 1 -> 2``, ``+ stage x``."""
    out = []
    for c in spec_diff.changes:
        if c.kind.name == "CHANGED" and (c.before is not None or c.after is not None):
            head = f"{c.section} {c.name}" if c.section in ("staleness", "placement") else c.name
            out.append(f"{head} {_short(c.before)} -> {_short(c.after)}")
        else:
            word = {"ADDED": "added", "REMOVED": "removed"}.get(c.kind.name, "changed")
            out.append(f"{c.section} {c.name} {word}")
    return out


def _short(v: str | None, width: int = 32) -> str:
    v = "-" if v is None else str(v)
    return v if len(v) <= width else v[:width - 3] + "..."


def cost_sentence(changes: list[str], a: dict, b: dict) -> str | None:
    """``<changes>: predicted step time <+x%>, peak memory <+n GB on GPUs ..>``; None when
    either side has no prediction."""
    if "error" in a or "error" in b or not a.get("step_time_s") or not b.get("step_time_s"):
        return None
    what = ", ".join(changes[:MAX_CHANGES]) or "no change"
    if len(changes) > MAX_CHANGES:
        rest = len(changes) - MAX_CHANGES
        what += f" and {rest} more change{'s' if rest > 1 else ''}"
    ta, tb = a["step_time_s"], b["step_time_s"]
    parts = [f"predicted step time {_pct(ta, tb)}"]
    same_layout = a.get("layout") == b.get("layout")
    parts.append("peak memory " + memory_words(a.get("peak_memory_per_device") or [],
                                               b.get("peak_memory_per_device") or [],
                                               a.get("peak_memory_bytes"),
                                               b.get("peak_memory_bytes"), same_layout))
    return f"{what}: " + ", ".join(parts)


def memory_words(pa: list[float], pb: list[float], max_a: float | None = None,
                 max_b: float | None = None, same_layout: bool = True) -> str:
    """``+3 GB on GPUs 0-15, -1 GB on GPUs 16-31`` or ``unchanged`` when the stages sit on
    the same devices in both; else the largest per-GPU peaks, ``+4 GB per GPU at most
    (84 GB -> 88 GB)``, since device i then holds different things in A and B."""
    eps = max(MEMORY_EPS * max(list(pa) + list(pb) + [max_a or 0.0, max_b or 0.0]), 1.0)
    if pa and pb and len(pa) == len(pb) and same_layout:
        deltas = [y - x for x, y in zip(pa, pb, strict=True)]
        by_delta: dict[int, list[int]] = {}          # moves equal within eps share a group
        for d, v in enumerate(deltas):
            if abs(v) >= eps:
                by_delta.setdefault(round(v / eps), []).append(d)
        if not by_delta:
            return "unchanged"
        parts = sorted(((sum(deltas[d] for d in devs) / len(devs), devs)
                        for devs in by_delta.values()), key=lambda kv: -abs(kv[0]))
        text = [f"{_bytes(v, signed=True)} on GPU{'s' if len(devs) > 1 else ''} "
                f"{device_ranges(tuple(devs))}" for v, devs in parts[:2]]
        if len(parts) > 2:
            text.append(f"other changes on {sum(len(d) for _, d in parts[2:])} GPUs")
        return ", ".join(text)
    x = max_a if max_a is not None else max(pa, default=0.0)
    y = max_b if max_b is not None else max(pb, default=0.0)
    if abs(y - x) < eps:
        return f"unchanged at {_bytes(x)} per GPU at most"
    return f"{_bytes(y - x, signed=True)} per GPU at most ({_bytes(x)} -> {_bytes(y)})"


def _pct(a: float, b: float) -> str:
    if not a:
        return f"{a:.3g} s -> {b:.3g} s"
    r = (b - a) / a
    if b / a >= 2 or b / a <= 0.5:
        return f"{b / a:.3g}x"
    return "unchanged" if abs(r) < 0.005 else f"{r:+.0%}" if abs(r) >= 0.1 else f"{r:+.1%}"


def _bytes(v: float, signed: bool = False) -> str:
    sign = "+" if signed and v > 0 else ""
    if abs(v) >= 1e9:
        g = v / 1e9
        return f"{sign}{g:.0f} GB" if abs(g) >= 10 or float(round(g)) == round(g, 1) \
            else f"{sign}{g:.1f} GB"
    m = v / 1e6
    return f"{sign}{m:.0f} MB" if abs(m) >= 10 else f"{sign}{m:.1f} MB"


def cost_lines(spec_diff, predicted: dict) -> list[str]:
    """The sentence for ``rpeg diff A B --cluster C`` (``predicted`` as the CLI builds it)."""
    s = cost_sentence(change_words(spec_diff), predicted.get("a", {}), predicted.get("b", {}))
    return [s] if s else []
