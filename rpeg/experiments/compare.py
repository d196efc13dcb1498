"""``rpeg diff RUN_A RUN_B``: what differs between two experiments, then what it did.

    >>> d = diff_runs("runs/tiny_ppo-a", "runs/tiny_ppo-b")          # doctest: +SKIP
    >>> print(d.text())                                               # doctest: +SKIP
    --- runs/tiny_ppo-a (record 3bf6ffd3cf91)
    +++ runs/tiny_ppo-b (record 81a0c2e9d7f4)
    inputs
      plan      164125e474f5 -> 0c1d2e3f4a5b
    plan
      staleness rollout: 1 -> 0
    consequences                  A           B           change
      predicted step time         0.054 s     0.061 s     +13%
      measured step time          0.387 s     0.402 s     +3.9%
      ...
    curves side by side: runs/tiny_ppo-b/plots/compare-tiny_ppo-a.png (.svg)

First the inputs (by the content hashes of the records), then the spec diff
(semantic, as for two spec files) and the plan diff, then the consequences:
predicted and measured step time, predicted peak memory per device (as a
sentence naming the devices), the final metrics, and a picture of both runs'
curves on the same axes. ``changed`` is true when the experiments differ in
what they ran (spec, plan, cluster or code), not merely in what they measured:
two runs of one experiment differ only by noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from rpeg.experiments.explain import change_words, cost_sentence
from rpeg.experiments.runs import Run

INPUTS = ("spec", "pipeline", "plan", "cluster")
METRICS = ("reward", "kl", "value_loss", "policy_loss", "entropy", "clip_frac", "tokens_per_s",
           "response_len")


@attrs.frozen
class RunDiff:
    a: str
    b: str
    ids: tuple[str, str]
    inputs: tuple[tuple[str, str | None, str | None], ...]   # (what, hash in A, hash in B), differing
    spec: object                                               # rpeg.spec.diff.SpecDiff
    plan: object                                               # rpeg.plan.diff.PlanDiff
    figures: tuple[tuple[str, float | None, float | None, str], ...]   # (what, A, B, unit)
    sentence: str | None
    pictures: tuple[str, ...]

    @property
    def changed(self) -> bool:
        return bool(self.inputs) or self.spec.changed or not self.plan.same

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "records": list(self.ids), "changed": self.changed,
                "inputs": [{"what": w, "a": x, "b": y} for w, x, y in self.inputs],
                "spec": self.spec.to_dict(), "plan": self.plan.to_dict(),
                "consequences": {w: {"a": x, "b": y, "unit": u, "change": _rel(x, y)}
                                 for w, x, y, u in self.figures},
                "predicted_cost": self.sentence, "pictures": list(self.pictures)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def text(self) -> str:
        lines = [f"--- {self.a} (record {self.ids[0]})", f"+++ {self.b} (record {self.ids[1]})"]
        if self.inputs:
            lines.append("inputs")
            lines += [f"  {w:<9} {_h(x)} -> {_h(y)}" for w, x, y in self.inputs]
        else:
            lines.append("inputs: the same spec, plan, cluster and code (runs of one experiment)")
        spec_text = self.spec.text().splitlines()[2:]
        if spec_text:
            lines.append("spec")
            lines += ["  " + t for t in spec_text]
        if not self.plan.same:
            lines.append("plan")
            lines += ["  " + t.strip() for t in str(self.plan).splitlines()[1:]
                      if not t.strip().startswith("predicted")]
        rows = [("consequences", "A", "B", "change")]
        for what, x, y, unit in self.figures:
            rows.append((f"  {what}", _v(x, unit), _v(y, unit), _change(x, y, unit)))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                  for r in rows]
        if self.sentence:
            lines.append(f"  {self.sentence}")
        if self.pictures:
            png = [p for p in self.pictures if p.endswith(".png")]
            lines.append(f"curves side by side: {', '.join(png)} (and .svg)")
        return "\n".join(lines) + "\n"


def diff_runs(a: str | Path, b: str | Path, plot_dir: str | Path | None = None,
              plots_in_b: bool = False) -> RunDiff:
    """Compare two run directories; the curves picture goes to ``plot_dir`` (or, with
    ``plots_in_b``, ``B/plots``, as ``rpeg show --plots`` writes a run's) as
    ``compare-<A's name>.png`` and ``.svg``; with neither, nothing is written."""
    from rpeg.experiments import plots
    from rpeg.plan.diff import diff_plans
    from rpeg.spec.diff import diff

    ra, rb = Run.open(a), Run.open(b)
    ia, ib = ra.record.get("inputs", {}), rb.record.get("inputs", {})
    inputs = []
    for what in INPUTS:
        x, y = (ia.get(what) or {}).get("sha256"), (ib.get(what) or {}).get("sha256")
        if x != y:
            inputs.append((what, x, y))
    ca, cb = ia.get("code", {}), ib.get("code", {})
    code_a = f"rpeg {ca.get('rpeg')} {ca.get('git_commit', '')[:12]}".strip()
    code_b = f"rpeg {cb.get('rpeg')} {cb.get('git_commit', '')[:12]}".strip()
    if code_a != code_b:
        inputs.append(("code", code_a, code_b))
    oa, ob = ((r.get("spec") or {}).get("overrides") or [] for r in (ia, ib))
    if oa != ob:                                   # rpeg run SPEC KEY=VALUE ...
        inputs.append(("overrides", " ".join(oa) or "none", " ".join(ob) or "none"))
    spec = diff(ra.pipeline, rb.pipeline)
    plan = diff_plans(ra.plan, rb.plan, ra.name, rb.name)
    pa, pb = ra.record.get("predicted", {}), rb.record.get("predicted", {})
    figures = [("predicted step time", pa.get("step_time_s"), pb.get("step_time_s"), "s"),
               ("measured step time", ra.measured_step_s(), rb.measured_step_s(), "s"),
               ("predicted peak memory", _max(pa.get("peak_memory")),
                _max(pb.get("peak_memory")), "B"),
               ("steps run", ra.record.get("measured", {}).get("steps_done"),
                rb.record.get("measured", {}).get("steps_done"), "")]
    fa, fb = ra.record.get("final", {}), rb.record.get("final", {})
    figures += [(f"final {k}", fa.get(k), fb.get(k), "") for k in METRICS if k in fa or k in fb]
    ea, eb = (r.record.get("eval") or [{}] for r in (ra, rb))
    figures += [(f"last eval {k}", ea[-1].get(k), eb[-1].get(k), "")
                for k in ("reward", "accuracy") if k in ea[-1] or k in eb[-1]]
    changes = change_words(spec) + _plan_words(plan)
    sentence = cost_sentence(changes, _cost(pa, ra.plan), _cost(pb, rb.plan)) \
        if (changes and "error" not in pa and "error" not in pb) else None
    folder = Path(plot_dir) if plot_dir else rb.path / "plots" if plots_in_b else None
    pics = () if folder is None else plots.compare(
        [(f"A: {ra.name}", list(ra.rows)), (f"B: {rb.name}", list(rb.rows))],
        folder / f"compare-{ra.name}", title=f"{ra.name} (A) vs {rb.name} (B)",
        keys=("reward", "kl", "step_time_s", "value_loss", "entropy", "tokens_per_s"))
    return RunDiff(str(a), str(b), (ra.record.get("id", "?"), rb.record.get("id", "?")),
                   tuple(inputs), spec, plan, tuple(figures), sentence,
                   tuple(str(p) for p in pics))


def _cost(predicted: dict, plan) -> dict:
    return {"step_time_s": predicted.get("step_time_s"),
            "peak_memory_per_device": predicted.get("peak_memory"),
            "layout": {p.stage: list(p.devices) for p in plan.placements}}


def _plan_words(plan) -> list[str]:
    """The plan's structural changes, then how many stages were placed differently."""
    words = [f"{what} {x} -> {y}" for what, x, y in plan.structure
             if what not in ("pipeline", "cluster")]
    n = len(plan.placements)
    if n:
        words.append(f"placement of {n} stage{'s' if n > 1 else ''}")
    return words


def _max(values) -> float | None:
    return max(values) if values else None


def _h(x: str | None) -> str:
    return "-" if x is None else x[:12] if len(x) == 64 else x


def _v(x, unit: str) -> str:
    if x is None:
        return "-"
    if unit == "B":
        return f"{x / 1e9:.3g} GB" if x >= 1e9 else f"{x / 1e6:.3g} MB"
    if unit == "s":
        return f"{x:.3g} s"
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _rel(x, y) -> float | None:
    if x is None or y is None or not x:
        return None
    return (y - x) / abs(x)


def _change(x, y, unit: str) -> str:
    if x is None or y is None:
        return ""
    if unit in ("s", "B"):
        r = _rel(x, y)
        if r is None:
            return ""
        return f"{y / x:.3g}x" if x > 0 and (y / x >= 2 or y / x <= 0.5) else f"{r:+.1%}"
    d = y - x
    return f"{d:+.4g}"
