"""Pictures of plans and runs (matplotlib, each written as PNG and SVG).

    >>> paths = run_plots("runs/tiny_ppo-20261130-011500")            # doctest: +SKIP
    >>> sorted(p.name for p in paths)                                   # doctest: +SKIP
    ['curves.png', 'curves.svg', 'memory.png', 'memory.svg', 'timeline.png', 'timeline.svg']

* :func:`timeline` — the plan's simulated Gantt chart above the run's measured
  timeline (from trace.json), one row per device, one colour per op in both, so
  the predicted overlap can be checked against what happened.
* :func:`memory` — predicted peak memory per device against the device's capacity.
* :func:`curves` — reward, KL, losses and step time per step from metrics.jsonl,
  the predicted step time drawn across the step-time panel.
* :func:`compare` — the curves of several runs on the same axes (``rpeg diff``).

Every function takes plain values (event lists, byte counts, metric rows) and a
path without suffix, and returns the files it wrote.
"""

from __future__ import annotations

from pathlib import Path

GB = 1e9
# The metrics drawn by ``curves``, in this order, when the run has them.
CURVES = (("reward", "reward"), ("kl", "KL"), ("step_time_s", "step time (s)"),
          ("policy_loss", "policy loss"), ("value_loss", "value loss"),
          ("entropy", "entropy"), ("clip_frac", "clip fraction"),
          ("tokens_per_s", "generated tokens/s"), ("response_len", "response length"),
          ("eval.reward", "eval reward (held out)"), ("eval.accuracy", "eval accuracy"))
HOST = -1


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, base: str | Path) -> tuple[Path, Path]:
    """Write ``base.png`` and ``base.svg`` (each through a temporary sibling,
    ``rpeg.destinations``); close the figure."""
    from rpeg.destinations import written
    base = Path(base)
    base.parent.mkdir(parents=True, exist_ok=True)
    png, svg = base.with_suffix(".png"), base.with_suffix(".svg")
    try:
        with written(png, "the picture") as tmp:
            fig.savefig(tmp, dpi=110)
        with written(svg, "the picture") as tmp:
            fig.savefig(tmp)
    finally:
        _plt().close(fig)
    return png, svg


# --- timelines ----------------------------------------------------------------------------

def bars_from_timeline(timeline) -> list[tuple[str, int, int, float, float]]:
    """(op, step, device, start, end) per device of every simulated event (host: -1)."""
    out = []
    for e in timeline.events:
        for d in (e.devices or (HOST,)):
            out.append((e.instance.op, e.instance.step, d, e.start, e.end))
    return out


def bars_from_trace(events: list[dict], steps: int | None = None):
    """(op, step, device, start, end) of every traced op of the first ``steps`` steps,
    times from the first op's start."""
    evs = [e for e in events if steps is None or e.get("step", 0) < steps]
    if not evs:
        return []
    t0 = min(e["start"] for e in evs)
    return [(e["op"], e.get("step", 0), e.get("device", 0), e["start"] - t0, e["end"] - t0)
            for e in evs]


def timeline(panels: list[tuple[str, list[tuple[str, int, int, float, float]]]],
             base: str | Path, title: str = "", share_x: bool = False) -> tuple[Path, Path]:
    """One Gantt panel per (title, bars); rows are devices, colours are ops (same in all)."""
    plt = _plt()
    from matplotlib.patches import Patch

    panels = [(name, merge_rows(bars)) for name, bars in panels]
    ops = list(dict.fromkeys(op for _, bars in panels for op, *_ in bars))
    cmap = plt.get_cmap("tab10" if len(ops) <= 10 else "tab20")
    colour = {op: cmap(i % cmap.N) for i, op in enumerate(ops)}
    devices = sorted({d for _, bars in panels for _, _, d, _, _ in bars}, key=_label_key)
    height = 1.0 + 0.45 * max(len(devices), 1)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.2 + height * len(panels)),
                             sharex=share_x, squeeze=False)
    for ax, (name, bars) in zip(axes[:, 0], panels, strict=True):
        row = {d: i for i, d in enumerate(devices)}
        end = max((b[4] for b in bars), default=1.0) or 1.0
        for op, step, dev, start, stop in bars:
            shade = 1.0 if step % 2 == 0 else 0.55
            ax.barh(row[dev], max(stop - start, end * 2e-4), left=start, height=0.8,
                    color=colour[op], alpha=shade, edgecolor="black", linewidth=0.3)
            text = f"{op.split('.')[0]}@{step}"
            if stop - start > end * 0.0075 * (len(text) + 2):      # only where it fits
                ax.text((start + stop) / 2, row[dev], text, ha="center", va="center",
                        fontsize=6, clip_on=True)
        ax.set_yticks(range(len(devices)), devices)
        ax.set_ylim(len(devices) - 0.5, -0.5)
        ax.set_xlim(0, end * 1.01)
        ax.set_title(name, fontsize=10, loc="left")
        ax.set_xlabel("seconds")
        if not bars:
            ax.text(0.5, 0.5, "no events", transform=ax.transAxes, ha="center")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.legend(handles=[Patch(color=colour[o], label=o) for o in ops], fontsize=7,
               loc="lower center", ncol=min(len(ops), 8), frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return save(fig, base)


def merge_rows(bars):
    """One row per run of consecutive devices that ran the same ops (op, step, n-th call on
    the device); a row's bar for one of them spans its devices' earliest start to latest
    end. Rows are labelled by device ranges: 64 devices in 2 groups draw as 2 rows."""
    per: dict[int, list] = {}
    for b in sorted(bars, key=lambda b: b[3]):
        per.setdefault(b[2], []).append(b)
    keyed: dict[int, list] = {}
    for d, bs in per.items():
        seen: dict[tuple[str, int], int] = {}
        for op, step, _, start, stop in bs:
            k = seen.get((op, step), 0)
            seen[(op, step)] = k + 1
            keyed.setdefault(d, []).append(((op, step, k), start, stop))
    groups: list[list[int]] = []
    for d in sorted(keyed, key=_row_key):
        sig = frozenset(key for key, _, _ in keyed[d])
        prev = groups[-1][-1] if groups else None
        if prev is not None and HOST not in (d, prev) and prev == d - 1 and \
                frozenset(key for key, _, _ in keyed[prev]) == sig:
            groups[-1].append(d)
        else:
            groups.append([d])
    out = []
    for g in groups:
        label = "host" if g == [HOST] else (f"device {g[0]}" if len(g) == 1
                                            else f"devices {g[0]}-{g[-1]}")
        spans: dict[tuple[str, int, int], list[float]] = {}
        for d in g:
            for key, start, stop in keyed[d]:
                if key in spans:
                    spans[key] = [min(spans[key][0], start), max(spans[key][1], stop)]
                else:
                    spans[key] = [start, stop]
        out += [(op, step, label, a, b) for (op, step, _), (a, b) in spans.items()]
    return out


def _row_key(d: int) -> tuple[int, int]:
    return (1, 0) if d == HOST else (0, d)


def _label_key(label: str) -> tuple[int, int, int]:
    if label == "host":
        return (1, 0, 0)
    first = label.split()[-1].split("-")
    return (0, int(first[0]), int(first[-1]))


# --- memory -------------------------------------------------------------------------------

def device_groups(values: list[float]) -> list[tuple[int, int, float]]:
    """Consecutive devices with the same value, as (first, last, value)."""
    out: list[tuple[int, int, float]] = []
    for i, v in enumerate(values):
        if out and out[-1][2] == v and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i, v)
        else:
            out.append((i, i, v))
    return out


KINDS = (("weights", "#1f77b4"), ("grads", "#ff7f0e"), ("optimizer", "#2ca02c"),
         ("activations", "#d62728"), ("kv_cache", "#9467bd"), ("buffers", "#8c564b"))


def memory(peak: list[float], capacity: float, base: str | Path, title: str = "",
           max_bars: int = 64, kinds: list[dict] | None = None,
           reserve: float = 0.0) -> tuple[Path, Path]:
    """Predicted peak bytes per device as bars, the capacity as a red line. Past
    ``max_bars`` devices, runs of devices with the same peak share one bar. With ``kinds``
    (the prediction's ``memory``: per group of devices alike, its peak by kind), one bar per
    group stacked by kind (weights, gradients, optimizer state, activations, KV cache,
    buffers), and what a plan may use (the capacity less ``reserve``) as a dashed line."""
    if kinds:
        return _memory_kinds(kinds, capacity, reserve, base, title)
    plt = _plt()
    if len(peak) > max_bars:
        groups = device_groups(peak)
        labels = [f"{a}" if a == b else f"{a}-{b}" for a, b, _ in groups]
        values = [v for _, _, v in groups]
        xlabel = "devices (runs of equal peak memory)"
    else:
        labels = [str(i) for i in range(len(peak))]
        values = list(peak)
        xlabel = "device"
    top = max(values, default=0.0)
    on_scale = bool(capacity) and top >= 0.05 * capacity
    biggest = max(values + ([capacity] if on_scale else []), default=0.0)
    scale, unit = (GB, "GB") if biggest >= 1e9 else (1e6, "MB")
    fig, ax = plt.subplots(figsize=(max(6.0, min(16.0, 0.35 * len(values) + 3)), 4.2))
    fractions = [v / capacity if capacity else 0.0 for v in values]
    colours = ["#d62728" if f > 1 else "#ff7f0e" if f > 0.9 else "#1f77b4" for f in fractions]
    xs = range(len(values))
    ax.bar(xs, [v / scale for v in values], color=colours, edgecolor="black", linewidth=0.3)
    if on_scale:
        ax.axhline(capacity / scale, color="#d62728", linestyle="--", linewidth=1.2)
        ax.text(-0.5, capacity / scale, f" capacity {capacity / scale:.3g} {unit}",
                va="bottom", ha="left", color="#d62728", fontsize=8)
        ax.set_ylim(0, max(capacity, top) / scale * 1.12)
    else:
        ax.set_ylim(0, top / scale * 1.3 if top else 1)
        if capacity:
            ax.text(0.99, 0.97, f"capacity {capacity / GB:.3g} GB per device "
                    f"(off the scale: peak is {top / capacity:.2%} of it)",
                    transform=ax.transAxes, ha="right", va="top", color="#d62728", fontsize=8)
    if len(values) <= 24:
        for x, v, f in zip(xs, values, fractions, strict=True):
            ax.text(x, v / scale, f"{v / scale:.3g}\n{_pct(f)}" if capacity else f"{v / scale:.3g}",
                    ha="center", va="bottom", fontsize=7)
    step = max(1, len(labels) // 32)
    ax.set_xticks(list(xs)[::step], labels[::step], rotation=90 if len(labels) > 16 else 0,
                  fontsize=7 if len(labels) > 16 else 9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"predicted peak memory ({unit})")
    ax.set_title(title or "predicted peak memory per device", fontsize=10)
    fig.tight_layout()
    return save(fig, base)


def _pct(f: float) -> str:
    return f"{f:.0%}" if f >= 0.1 else f"{f:.2%}" if f >= 0.0001 else f"{f:.1e}"


# --- metric curves --------------------------------------------------------------------------

def curves(rows: list[dict], base: str | Path, title: str = "",
           predicted_step_s: float | None = None) -> tuple[Path, Path]:
    """The run's metrics per step, one panel each (those of CURVES the run has)."""
    return compare([("", rows)], base, title=title, predicted_step_s=predicted_step_s)


def compare(runs: list[tuple[str, list[dict]]], base: str | Path, title: str = "",
            predicted_step_s: float | None = None,
            keys: tuple[str, ...] | None = None) -> tuple[Path, Path]:
    """The metrics of several runs on shared axes: one panel per metric, one line per run."""
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    present = [(k, label) for k, label in CURVES
               if (keys is None or k in keys) and any(k in r for _, rows in runs for r in rows)]
    if not present:
        present = [("step_time_s", "step time (s)")]
    cols = min(3, len(present))
    nrows = -(-len(present) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.0 * nrows), squeeze=False)
    for ax in axes.flat[len(present):]:
        ax.set_visible(False)
    steps = [r["step"] for _, rows in runs for r in rows if "step" in r] or [0]
    for ax, (key, label) in zip(axes.flat, present, strict=False):
        for i, (_, rows) in enumerate(runs):
            pts = [(r["step"], r[key]) for r in rows if key in r and "step" in r]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3,
                        linewidth=1.2, color=f"C{i}")
        ax.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
        if key == "step_time_s" and predicted_step_s:
            ax.axhline(predicted_step_s, color="grey", linestyle="--", linewidth=1)
            ax.text(0.02, predicted_step_s, f"predicted {predicted_step_s:.3g} s",
                    transform=ax.get_yaxis_transform(), va="bottom", fontsize=7, color="grey")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    if any(name for name, _ in runs):
        from matplotlib.lines import Line2D
        handles = [Line2D([], [], color=f"C{i}", marker="o", markersize=3, label=name)
                   for i, (name, _) in enumerate(runs)]
        fig.legend(handles=handles, loc="lower center", ncol=len(runs), fontsize=8,
                   frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.05 if len(runs) > 1 else 0, 1, 1))
    return save(fig, base)


def _memory_kinds(groups: list[dict], capacity: float, reserve: float, base, title: str):
    from rpeg.plan.model import device_ranges
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.0, min(16.0, 0.6 * len(groups) + 4)), 4.2))
    xs = range(len(groups))
    bottom = [0.0] * len(groups)
    for kind, colour in KINDS:
        vals = [g.get(kind, 0.0) / GB for g in groups]
        if any(vals):
            ax.bar(xs, vals, bottom=bottom, color=colour, edgecolor="black", linewidth=0.3,
                   label=kind.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    if capacity:
        ax.axhline(capacity / GB, color="#d62728", linewidth=1.2)
        ax.text(-0.5, capacity / GB, f" capacity {capacity / GB:.3g} GB", va="bottom",
                ha="left", color="#d62728", fontsize=8)
        if reserve:
            usable = (capacity - reserve) / GB
            ax.axhline(usable, color="#d62728", linestyle="--", linewidth=1.0)
            ax.text(len(groups) - 0.5, usable, f"usable {usable:.3g} GB (reserve "
                    f"{reserve / capacity:.0%}) ", va="bottom", ha="right", color="#d62728",
                    fontsize=8)
        ax.set_ylim(0, max(capacity / GB, max(bottom, default=0.0)) * 1.12)
    ax.set_xticks(list(xs), [device_ranges(tuple(g["devices"])) for g in groups],
                  rotation=90 if len(groups) > 12 else 0, fontsize=8)
    ax.set_xlabel("devices (groups holding the same models and peak op)")
    ax.set_ylabel("predicted peak memory (GB)")
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title(title or "predicted peak memory by kind", fontsize=10)
    fig.tight_layout()
    return save(fig, base)
