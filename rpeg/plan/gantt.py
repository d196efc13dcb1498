"""Draw a simulated timeline: one row per device group, one colour per op, steps shaded.

    >>> draw(timeline, "gantt.png", title="ppo_llama8b on gh200_64")     # doctest: +SKIP

The title quotes the plan's predicted step (``step_s``: the ops' timeline plus the control
plane and any held-out evaluation, as ``rpeg show`` prints it). Rows are the device groups
the plan uses (maximal sets of devices that always work together); an op holding several
groups draws a bar in each. Successive
steps alternate between a full and a lighter shade of the op's colour, and each
bar carries ``op@step`` when it is wide enough to read.
"""

from __future__ import annotations

from pathlib import Path

from rpeg.plan.model import device_ranges
from rpeg.plan.simulate import Timeline, groups_of


def step_words(step_s: float | None, timeline: Timeline) -> str:
    """The one predicted step time a picture of ``timeline`` quotes: the plan's (its ops'
    timeline, plus the control plane on the devices' cores and a held-out evaluation's
    share), and how much of it the timeline drawn holds.

        >>> from types import SimpleNamespace
        >>> step_words(0.113, SimpleNamespace(step_time_s=0.083))
        'predicted step 0.113 s, of it 0.083 s the ops drawn'
    """
    ops = timeline.step_time_s
    if step_s is None or abs(step_s - ops) <= 1e-9 * max(step_s, 1.0):
        return f"predicted step {ops:.3g} s"
    return f"predicted step {step_s:.3g} s, of it {ops:.3g} s the ops drawn"


def draw(timeline: Timeline, path: str | Path, title: str = "",
         step_s: float | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    groups = groups_of(timeline.events)
    ops = list(dict.fromkeys(e.instance.op for e in timeline.events))
    cmap = plt.get_cmap("tab10" if len(ops) <= 10 else "tab20")
    colour = {op: cmap(i % cmap.N) for i, op in enumerate(ops)}
    end = max((e.end for e in timeline.events), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.55 * max(len(groups), 1)))
    host_row = len(groups)
    for e in timeline.events:
        rows = [i for i, g in enumerate(groups) if set(g) <= set(e.devices)] or [host_row]
        shade = 1.0 if e.instance.step % 2 == 0 else 0.55
        for r in rows:
            ax.barh(r, max(e.end - e.start, end * 1e-4), left=e.start, height=0.8,
                    color=colour[e.instance.op], alpha=shade, edgecolor="black", linewidth=0.3)
            if e.end - e.start > end / 40:
                ax.text((e.start + e.end) / 2, r, f"{e.instance.op}@{e.instance.step}",
                        ha="center", va="center", fontsize=6, clip_on=True)
    labels = [f"GPUs {device_ranges(g)}" for g in groups]
    if any(not e.devices for e in timeline.events):
        labels.append("host")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    lo, hi = timeline.window
    ax.axvspan(lo, hi, color="grey", alpha=0.08, zorder=0)
    ax.set_title(f"{title}  ({step_words(step_s, timeline)}; steady window shaded)".strip())
    ax.legend(handles=[Patch(color=colour[o], label=o) for o in ops], fontsize=7,
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=min(len(ops), 6))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
