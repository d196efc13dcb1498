"""Conversations: a generate stage with tools, priced turn by turn.

    >>> from rpeg.cost.turns import makespan
    >>> from rpeg.spec.tools import Latency
    >>> round(makespan(4, 4, Latency.fixed(2.0)), 3)         # four calls, four slots: at once
    2.0
    >>> round(makespan(8, 4, Latency.fixed(2.0)), 3)         # eight: two waves
    4.0

A conversation's turns run in rounds, as the engines run them (``backends.turns``): every
live sample's policy decodes one turn, then the turn's tool calls run, then the next round.
A round is priced as a generate stage of its own -- the samples still talking, each
prefilling the context that is new to the engine (the torch engine rebuilds its cache
from the whole conversation every turn; vLLM's prefix cache holds the earlier turns, so
only the last observation is new) and decoding one turn of the workload's ``gen_len`` --
plus the tool calls: each call takes the tools' declared ``latency`` (the profile's
``tool_call_s`` where a tool declares none), and the calls of a replica run on the host
cores its devices' nodes give tool executors (the cluster's ``tool_cores`` per node, each
call its tool's ``cores``), so many calls on few cores queue and the slowest call of a
round holds the round's end. ``turns`` and ``obs_len`` of the stage give how many samples
are still talking at each round and how long each observation is.

Under partial rollouts (a plan's carry c) the step ends when its own conversations end:
each step runs ``ceil(max_turns / (c + 1))`` rounds over c + 1 cohorts of conversations
(the later ones pause between turns and resume at the next step under newer weights), so a
step pays fewer rounds' tails for more samples a round.
"""

from __future__ import annotations

import functools
import heapq
import math

import attrs
import numpy as np

from rpeg.cost import compute as C
from rpeg.cost.engines import engine_terms
from rpeg.cost.generation import (
    Gen,
    StageCost,
    carries,
    conversation_workload,
    generation,
    mean_len,
)
from rpeg.spec.model import Engine

MAX_CALLS = 4096           # calls a round's queue is priced with, at most (then scaled)


def survival(conv) -> np.ndarray:
    """``out[k]``: the share of samples with more than ``k`` policy turns (k = 0..max)."""
    t = conv.turns.quantiles(1024)
    return np.array([float((t > k).mean()) for k in range(conv.max_turns + 1)])


def latency_quantiles(tools, gpu, n: int) -> np.ndarray:
    """``n`` call durations of the stage's tools (an equal mix of them), ascending."""
    parts = [_capped(t, t.latency.quantiles(n) if t.latency is not None
                     else np.full(n, gpu.tool_call_s)) for t in tools] \
        or [np.full(n, gpu.tool_call_s)]
    mixed = np.sort(np.concatenate(parts))
    idx = ((np.arange(n) + 0.5) / n * len(mixed)).astype(int)
    return mixed[idx]


def makespan(calls: int, slots: int, latency, gpu=None) -> float:
    """Seconds until ``calls`` calls of ``latency`` finish on ``slots`` slots, started in an
    order unrelated to their durations, each on the first free slot."""
    if calls <= 0:
        return 0.0
    return _makespan(calls, max(int(slots), 1), latency if isinstance(latency, tuple) else
                     tuple(latency.quantiles(min(calls, MAX_CALLS))))


@functools.lru_cache(maxsize=4096)
def _makespan(calls: int, slots: int, durations: tuple) -> float:
    n = min(calls, MAX_CALLS)
    scale = calls / n
    q = np.asarray(durations, float)
    q = q[((np.arange(n) + 0.5) / n * len(q)).astype(int)]
    order = np.argsort((np.arange(n) * 0.6180339887498949) % 1.0, kind="stable")
    k = max(int(round(slots / scale)), 1) if scale > 1 else slots
    if k >= n:
        return float(q.max())
    free = [0.0] * k
    for j in order:
        heapq.heappush(free, heapq.heappop(free) + float(q[j]))
    return float(max(free))


def tool_slots(cluster, par, tools) -> float:
    """Calls one replica of the stage runs at once: its devices' share of their nodes'
    tool cores, over the cores a call takes. Below 1 where a node has fewer tool cores
    than replicas: each replica's sandbox still runs a call at a time (``rpeg.runtime.
    lowering.context.tool_slots``), on a share of a core, so each call takes 1 / share
    as long (:func:`tool_time`)."""
    per_device = cluster.tool_cores_per_node / max(cluster.gpus_per_node, 1)
    cores = max((t.cores for t in tools), default=1)
    return per_device * par.tp * par.pp / cores


def tool_time(calls: int, slots: float, durations: tuple) -> float:
    """Seconds of a replica's ``calls`` tool calls of ``durations`` on ``slots`` slots
    (:func:`tool_slots`): whole slots at once, a share of one slower by that share."""
    return makespan(calls, max(int(slots), 1), durations) / min(slots, 1.0)


def _capped(tool, q: np.ndarray) -> np.ndarray:
    """Call durations no longer than the tool's timeout, where the sandbox kills a call."""
    return np.minimum(q, tool.timeout)


@attrs.frozen
class Round:
    """One round of a step's conversations, as priced."""

    turn: int                 # the own cohort's turn (1-based)
    rows: float               # samples decoding a turn, all cohorts
    generate_s: float
    tools_s: float
    calls: float


def rounds(work, par, devices, topo, cluster, batch: int, engine: Engine, rows=None,
           partial: int = 0) -> tuple[list[Round], list[Gen]]:
    """The rounds of one step of a conversation stage and each round's generation."""
    conv, w, gpu = work.conversation, work.workload, cluster.gpu
    c = carries(work, partial)
    per_step = math.ceil(conv.max_turns / (c + 1))
    alive = survival(conv)
    turn_len = mean_len(w.gen_len)
    obs = mean_len(conv.obs_len)
    paged = engine_terms(engine, gpu).paged
    slots = tool_slots(cluster, par, work.tools)
    out, gens = [], []
    for j in range(per_step):
        turns = [a * per_step + j for a in range(c + 1)]      # 0-based turn of each cohort
        weights = np.array([alive[t] if t < conv.max_turns else 0.0 for t in turns])
        live = batch * float(weights.sum())
        if live < 0.5:
            break
        # context before each cohort's turn: the prompt, then turns and observations
        before = np.array([t * (turn_len + obs) for t in turns])
        context = float((weights * before).sum() / weights.sum())
        reused = max(context - obs, 0.0) if paged and context > 0 else 0.0
        wk = attrs.evolve(w, prompt_len=max(int(round(w.prompt_len + context)), 1),
                          prompt_dist=None) if context > 0 else w
        g = generation(work.model, par, devices, topo, cluster, max(int(math.ceil(live)), 1),
                       wk, engine, rows, 0, reused)
        # the samples that go on call a tool (or step their environment) before the next
        step = 0 if conv.environment is not None else 1      # an environment steps every turn
        calls = batch * sum(alive[t + step] for t in turns if t + step <= conv.max_turns)
        local = math.ceil(calls / par.dp)
        durations = tuple(latency_quantiles(work.tools, gpu, min(max(local, 1), MAX_CALLS)))
        t_tools = tool_time(local, slots, durations)
        out.append(Round(j + 1, live, g.cost.time_s, t_tools, calls))
        gens.append(g)
    return out, gens


def conversation_gen(work, par, devices, topo, cluster, batch: int, engine: Engine,
                     rows=None, partial: int = 0) -> Gen:
    """A conversation stage's cost, and when each of its own samples is done (the ones
    that stop at a round finish with that round's generation)."""
    conv = work.conversation
    rs, gens = rounds(work, par, devices, topo, cluster, batch, engine, rows, partial)
    alive = survival(conv)
    c = carries(work, partial)
    local = math.ceil(batch / par.dp)
    compute = comm = prefill = host = start = 0.0
    finish, lengths, parts = [], [], []
    turn_len = mean_len(work.workload.gen_len)
    obs = mean_len(conv.obs_len)
    for k, (r, g) in enumerate(zip(rs, gens, strict=True)):
        compute += g.cost.compute_s
        comm += g.cost.comm_s
        prefill += g.prefill
        host += g.host
        # own samples (cohort 0) that stop after this round: they finish with its decoding
        own_turn = k if c == 0 else k + c * len(rs)
        stop = alive[own_turn] - (alive[own_turn + 1] if own_turn + 1 < len(alive) else 0.0)
        if k == len(rs) - 1:
            stop = alive[own_turn]
        n = int(round(local * stop))
        if n > 0:
            # the conversations that ended in a round are handed on when the round is over:
            # after its decoding, and after the tool calls of those that go on (the engines
            # yield a round's ended ones once its calls ran, backends.turns.converse)
            idx = np.linspace(0, len(g.finish) - 1, n).round().astype(int)
            finish.append(np.full(n, start + r.generate_s + r.tools_s))
            lengths.append(own_turn * (turn_len + obs) + g.lengths[idx])
        parts += [(f"turn {r.turn} generation", r.generate_s), (f"turn {r.turn} tools",
                                                                r.tools_s)]
        start += r.generate_s + r.tools_s
    tools = sum(r.tools_s for r in rs)
    cost = StageCost(start, compute + tools, comm,
                     (("prefill", prefill), ("decode", start - prefill - tools - host),
                      ("host", host), ("tools", tools)) + tuple(parts),
                     sum((g.cost.roof for g in gens), C.Roof()))   # every round's FLOPs, bytes
    fin = np.sort(np.concatenate(finish)) if finish else np.array([start])
    lens = np.concatenate(lengths) if lengths else np.array([1.0])
    order = np.argsort(np.concatenate(finish)) if finish else np.array([0])
    return Gen(cost, prefill, host, np.array([0.0]), np.array([0.0]),
               lens[order] if len(lens) == len(order) else lens, np.minimum(fin, start))


__all__ = ["Round", "carries", "conversation_gen", "conversation_workload", "latency_quantiles", "makespan", "rounds",
           "survival", "tool_slots", "tool_time"]
