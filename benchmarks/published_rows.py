"""The published step times rpeg's GPU cost model is checked against, and how each is priced.

    >>> row = ROWS["ORB-4"]
    >>> row.figures["step"], row.spec
    (885.16, 'orb/orb4_vllm_7b.rpeg')
    >>> result = price(row)                                  # doctest: +SKIP
    >>> result.status, round(result.predicted["step"])       # doctest: +SKIP
    ('ok', 884)

Each row of the calibration set (``/work/shared/published-calibration.md``: the source,
the measured figure, the configuration) is a spec under ``benchmarks/published/`` with
the placement the published system used pinned (``place``) and every assumption the
source leaves open stated in the file, a cluster file, the figures the source printed
(the step, and where it splits them the generation / old-log-probability / training
phases), and the stages each phase covers. A row is priced as it ran
(:func:`rpeg.plan.known.pinned_plan`: ``rpeg compile --strategy pinned``), except ReaL's
own bars, whose searched plans are not published: those are priced with rpeg's search
over the space ReaL searched. A phase's predicted time is the span of its stages in one
steady step of the simulated timeline.
"""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rpeg.errors import RpegError  # noqa: E402
from rpeg.plan.compile import compile_report  # noqa: E402
from rpeg.plan.evaluate import Evaluator  # noqa: E402
from rpeg.plan.known import pinned_plan  # noqa: E402
from rpeg.plan.model import Strategy  # noqa: E402
from rpeg.plan.options import SearchOptions  # noqa: E402
from rpeg.plan.space import Limits  # noqa: E402
from rpeg.spec import load, load_cluster  # noqa: E402

SPECS = ROOT / "benchmarks" / "published"
EPOCH_SAMPLES = 264_292          # DeepSpeed-Chat's benchmark epoch (BenckmarkSetting.md)
SEARCH_BUDGET = 400              # proposals a walk, for the rows priced by search


@attrs.frozen
class Row:
    id: str
    source: str                        # the source, for leave-one-source-out
    system: str
    spec: str                          # under benchmarks/published/
    cluster: str
    figures: tuple[tuple[str, float], ...]   # (what, seconds) as published
    main: str = "step"                 # the figure the aggregates score
    phases: tuple[tuple[str, tuple[str, ...]], ...] = ()   # (figure, stages it spans)
    scale: float = 1.0                 # published main figure / one priced step
    strategy: Strategy = Strategy.PINNED
    unwritable: str = ""               # why the configuration cannot be written yet
    # a controller dispatches the system's ops one call at a time (Ray-based OpenRLHF, verl,
    # NeMo RL, ReaL's master and workers); DeepSpeed-Chat and OpenRLHF's DeepSpeed launcher
    # run every model in one program on every GPU, with no controller between the calls
    controller: bool = True

    @property
    def figure(self) -> float:
        return dict(self.figures)[self.main]


@attrs.frozen
class Result:
    row: Row
    status: str                        # ok | no-fit | unwritable | error
    predicted: dict = attrs.field(factory=dict)        # figure -> seconds
    message: str = ""
    plan: object = attrs.field(default=None, eq=False, repr=False)   # the plan priced

    @property
    def ratio(self) -> float | None:
        """Predicted over published, of the row's main figure."""
        if self.status != "ok":
            return None
        return self.predicted[self.row.main] / self.row.figure

    @property
    def time_ratio(self) -> float | None:
        """The same, also for a plan that does not fit (its time priced regardless)."""
        got = self.predicted.get(self.row.main)
        return None if got is None or math.isnan(got) else got / self.row.figure


# --- the rows ----------------------------------------------------------------------------

EXPERIENCE = ("rollout", "old_lp", "ref_lp", "values", "scores")
UPDATES = ("actor_step", "critic_step")
ORB_PHASES = (("gen", EXPERIENCE), ("train", UPDATES))


def _orb(rid, spec, cluster, step, gen, train, system, controller=True):
    return Row(rid, "openrlhf-benchmark", system, f"orb/{spec}", cluster,
               (("step", step), ("gen", gen), ("train", train)), phases=ORB_PHASES,
               controller=controller)


def _dsc(rid, spec, hours, batch):
    return Row(rid, "deepspeed-chat-blog", "DeepSpeed-Chat (Hybrid Engine)", f"dsc/{spec}",
               "a100_8.rpeg", (("epoch", hours * 3600),), main="epoch",
               scale=EPOCH_SAMPLES / batch, controller=False)


def _verl(rid, n, step, gen, old, update):
    return Row(rid, "verl-fully-async", "verl colocated sync", f"verl/verl_dapo_{n}.rpeg",
               f"h20_{n}.rpeg", (("step", step), ("gen", gen), ("old_lp", old),
                                 ("update", update)),
               phases=(("gen", ("rollout",)), ("old_lp", ("old_lp",)),
                       ("update", ("actor_step",))))


# ReaL's weak-scaling "Scale Actor" bars: (gen length) -> GPUs -> step seconds of
# DeepSpeed-Chat, OpenRLHF, ReaL-Heuristic, ReaL (None: no bar; the authors' DeepSpeed-Chat
# sweep, garrett4wade/DeepSpeedExamples @4b8f7b4 sosp_benchmark.py, ran no configuration with
# under 4 prompts a GPU, and 128 prompts on 64 GPUs are 2).
REAL_STEPS = {
    128: {8: (72.1, 157.3, 31.3, 23.3), 16: (57.0, 55.5, 30.1, 24.3),
          32: (106.0, 94.9, 34.0, 29.2), 64: (174.5, 189.9, 43.7, 41.6)},
    384: {8: (82.4, 203.6, 42.3, 28.0), 16: (75.0, 86.5, 42.6, 31.3),
          32: (126.5, 134.5, 50.5, 46.7), 64: (200.7, 273.0, 71.6, 65.9)},
    896: {8: (100.6, 256.5, 63.3, 37.4), 16: (112.2, 131.9, 69.1, 44.2),
          32: (167.7, 219.1, 84.7, 77.4), 64: (None, 459.8, 129.0, 123.8)},
}
REAL_SIZE = {8: "7b", 16: "13b", 32: "34b", 64: "70b"}
REAL_SYSTEMS = (("dschat", "DeepSpeed-Chat (ReaL's run)"), ("openrlhf", "OpenRLHF (ReaL's run)"),
                ("heuristic", "ReaL-Heuristic"), ("real", "ReaL"))


def _real_rows() -> list[Row]:
    out = []
    for gen, per in REAL_STEPS.items():
        for gpus, steps in per.items():
            for (name, system), step in zip(REAL_SYSTEMS, steps, strict=True):
                if step is None:
                    continue
                size = REAL_SIZE[gpus]
                suffix = "" if gen == 128 else f"_g{gen}"
                out.append(Row(f"REAL-{name}-{gpus}-g{gen}", "real-weak-scaling", system,
                               f"real/{name}_{size}{suffix}.rpeg", f"h100_{gpus}.rpeg",
                               (("step", step),),
                               strategy=Strategy.SEARCH if name == "real" else Strategy.PINNED,
                               controller=name != "dschat"))
    return out


_ROWS = [
    _orb("ORB-1", "orb1_dschat_7b.rpeg", "a800_8.rpeg", 1189.13, 697.12, 492.01,
         "DeepSpeed-Chat (no Hybrid Engine, ZeRO-Offload)", controller=False),
    _orb("ORB-2", "orb2_openrlhf_7b.rpeg", "a800_8.rpeg", 1177.78, 920.81, 256.97,
         "OpenRLHF (DeepSpeed)", controller=False),
    _orb("ORB-3", "orb3_ray_7b.rpeg", "a800_8.rpeg", 1894.46, 1498.77, 395.69, "OpenRLHF (Ray)"),
    _orb("ORB-4", "orb4_vllm_7b.rpeg", "a800_8.rpeg", 885.16, 481.86, 403.29,
         "OpenRLHF (Ray + vLLM)"),
    _orb("ORB-5", "orb5_dschat_13b.rpeg", "a800_8.rpeg", 3809.36, 2590.72, 1218.76,
         "DeepSpeed-Chat (no Hybrid Engine, ZeRO-Offload)", controller=False),
    _orb("ORB-6", "orb6_ray_13b.rpeg", "a800_8.rpeg", 3671.61, 2722.51, 949.10, "OpenRLHF (Ray)"),
    _orb("ORB-7", "orb7_vllm_13b.rpeg", "a800_8.rpeg", 2392.91, 1425.75, 967.15,
         "OpenRLHF (Ray + vLLM)"),
    _orb("ORB-8", "orb8_vllm_34b.rpeg", "a800_8.rpeg", 8814.25, 5518.07, 3296.18,
         "OpenRLHF (Ray + vLLM)"),
    _orb("ORB-9", "orb9_vllm_70b.rpeg", "a800_16.rpeg", 9822.62, 7122.65, 2699.97,
         "OpenRLHF (Ray + vLLM)"),
    _dsc("DSC-4", "dsc4_opt_6_7b.rpeg", 4.1, 1024),
    _dsc("DSC-5", "dsc5_opt_13b.rpeg", 9.0, 1024),
    _dsc("DSC-6", "dsc6_opt_30b.rpeg", 18.0, 32),
    _dsc("DSC-7", "dsc7_opt_66b.rpeg", 2.1 * 24, 32),
    _verl("VERL-5", 32, 790.10, 357.41, 107.71, 269.80),
    _verl("VERL-6", 64, 365.28, 150.72, 70.26, 133.41),
    _verl("VERL-7", 128, 356.30, 177.85, 53.92, 113.81),
    Row("VERL-14", "verl-vllm07", "verl rollout (vLLM 0.7.0, CUDA graphs)",
        "verl/verl14_qwen2_7b.rpeg", "h100_8.rpeg", (("gen", 62.0),), main="gen",
        phases=(("gen", ("rollout",)),)),
    *_real_rows(),
    Row("NEMO-B1", "nemo-rl-v0.4", "NeMo RL", "nemo/nemo_b1_llama3_8b.rpeg",
        "dgx_h100_16.rpeg", (("step", 97.7),)),
    Row("NEMO-B2", "nemo-rl-v0.4", "NeMo RL", "nemo/nemo_b2_qwen3_32b.rpeg",
        "dgx_h100_32.rpeg", (("step", 393.0),)),
    Row("NEMO-B3", "nemo-rl-v0.4", "NeMo RL", "nemo/nemo_b3_qwen3_235b.rpeg",
        "dgx_h100_128.rpeg", (("step", 506.0),)),
    Row("NEMO-B4", "nemo-rl-v0.4", "NeMo RL", "nemo/nemo_b4_deepseek_v3.rpeg",
        "dgx_h100_256.rpeg", (("step", 154.0),)),
]
ROWS: dict[str, Row] = {r.id: r for r in _ROWS}


# --- pricing ----------------------------------------------------------------------------------

def price(row: Row, limits: Limits | None = None, plan=None) -> Result:
    """The row's figures as rpeg predicts them; a status instead where it cannot.
    ``plan``: price this plan of the row (as an earlier ``price`` found it) instead of
    making it again."""
    if row.unwritable:
        return Result(row, "unwritable", message=row.unwritable)
    limits = Limits() if limits is None else limits
    try:
        pipeline, cluster = _loaded(row.spec, row.cluster)
        cluster = attrs.evolve(cluster, controller=row.controller)
        if plan is not None or row.strategy is Strategy.PINNED:
            plan = pinned_plan(pipeline, cluster, limits) if plan is None else \
                attrs.evolve(plan, predicted=None)
            ev = Evaluator(pipeline, cluster).evaluate(plan, simulate_infeasible=True)
        else:
            report = compile_report(pipeline, cluster, row.strategy,
                                    SearchOptions(seed=0, iterations=SEARCH_BUDGET,
                                                  limits=limits))
            ev = report.evaluation
    except RpegError as e:
        status = "no-fit" if "must fit" in e.message or "no plan fits" in e.message else "error"
        return Result(row, status, message=e.message)
    predicted = {"step": ev.timeline.step_time_s if ev.timeline else math.nan}
    predicted.update(phase_times(ev, row.phases) if ev.timeline else {})
    if row.main not in predicted:
        predicted[row.main] = predicted["step"]
    predicted[row.main] *= row.scale
    if not ev.feasible:
        sf = ev.shortfall
        return Result(row, "no-fit", predicted, f"needs {sf.need / 1e9:.1f} GB on GPU "
                                                f"{sf.device} of {sf.capacity / 1e9:.0f} GB",
                      plan=ev.plan)
    return Result(row, "ok", predicted, plan=ev.plan)


@functools.cache
def _loaded(spec: str, cluster: str):
    """The row's spec and cluster, read once (both are immutable values)."""
    return load(SPECS / spec), load_cluster(SPECS / "clusters" / cluster)


def phase_times(ev, phases) -> dict[str, float]:
    """Seconds each phase spans in one steady step: from the first start to the last end
    of its stages' instances in the middle step of the simulated timeline."""
    tl = ev.timeline
    steps = sorted({e.instance.step for e in tl.events})
    mid = steps[len(steps) // 2]
    out = {}
    for name, stages in phases:
        spans = [(e.start, e.end) for e in tl.events if e.instance.step == mid
                 and any(s in e.instance.op.split("+") for s in stages)]
        if spans:
            out[name] = max(b for _, b in spans) - min(a for a, _ in spans)
    return out


# --- scores ------------------------------------------------------------------------------------

def log2_error(r: Result) -> float | None:
    return None if r.ratio is None else abs(math.log2(r.ratio))


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    if len(xs) < 3:
        return float("nan")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx and vy else float("nan")


def _time_only(results: list[Result]) -> dict:
    """Median |log2 ratio| and Spearman of the step time alone, rows that do not fit
    included (their plans' times priced regardless of memory)."""
    rs = [r for r in results if r.time_ratio is not None]
    errs = sorted(abs(math.log2(r.time_ratio)) for r in rs)
    if not errs:
        return {"rows": 0}
    return {"rows": len(rs), "median_abs_log2": errs[len(errs) // 2],
            "within_2x": sum(e <= 1 for e in errs) / len(errs),
            "spearman": spearman([r.row.figure for r in rs],
                                 [r.predicted[r.row.main] for r in rs])}


def aggregates(results: list[Result]) -> dict:
    """The scores over rows: median |log2 ratio| of the priced rows, the share of all rows
    within 1.25x / 1.5x / 2x (a row not priced is not within), Spearman's rank correlation
    of the priced rows, and the false 'no plan fits' (configurations that really ran)."""
    priced = [r for r in results if r.status == "ok"]
    errs = sorted(log2_error(r) for r in priced)
    n = len(results)
    med = errs[len(errs) // 2] if len(errs) % 2 else (
        (errs[len(errs) // 2 - 1] + errs[len(errs) // 2]) / 2 if errs else float("nan"))
    within = {f"{k}x": sum(e <= math.log2(k) for e in errs) / n if n else 0.0
              for k in (1.25, 1.5, 2)}
    return {"rows": n, "priced": len(priced),
            "median_abs_log2": med,
            "within": within,
            "within_of_priced": {f"{k}x": sum(e <= math.log2(k) for e in errs) / len(errs)
                                 if errs else 0.0 for k in (1.25, 1.5, 2)},
            "spearman": spearman([r.row.figure for r in priced],
                                 [r.predicted[r.row.main] for r in priced]),
            "false_no_fit": sum(r.status == "no-fit" for r in results),
            "time_only": _time_only(results),
            "unwritable": sum(r.status == "unwritable" for r in results),
            "errors": sum(r.status == "error" for r in results)}
