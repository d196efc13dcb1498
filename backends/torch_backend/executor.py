"""The torch backend's side of an op call: model state per worker, and what each op does.

    >>> ex = Executor(ctx, device=0)          # once per worker, at set-up  # doctest: +SKIP
    >>> outputs, info = ex.run(call, {"responses": [chunk]})                # doctest: +SKIP
    >>> info["version_read"]                                                # doctest: +SKIP
    3

The runtime (``rpeg.runtime.worker``) times the call and records the trace
event; this module does the tensor work. Data in and out is plain numpy and
``RolloutChunk`` values. Each replica's ``version`` counts the optimizer steps
its weights have seen, and is what the trace reports as the version read; under
partial rollouts (``call.carry``) a generate op reports its chunk's oldest token's
version instead (the engine keeps the next steps' responses between steps).
"""

from __future__ import annotations

import importlib
import inspect
import sys

import attrs
import numpy as np
import torch

from backends.api import Cohort, RolloutChunk, SamplingParams
from backends.torch_backend import advantages as adv
from backends.torch_backend.generation import TorchEngine
from backends.torch_backend.modeling import build_model, load_checkpoint, save_checkpoint
from backends.torch_backend.tokenizer import codec_for
from backends.torch_backend.train import (
    LossSpec,
    TokenHeads,
    TrainBatch,
    forward_arrays,
    train_step,
)
from rpeg.errors import BackendError
from rpeg.runtime.context import group_of
from rpeg.runtime.data import reward_extras, step_rows, workload_rows
from rpeg.runtime.instances import EXPORT, RECV, SEND, OpCall, base_of
from rpeg.runtime.rewards import call_reward
from rpeg.spec.model import Engine, Head, OpKind

BUCKET_BYTES = 32 << 20          # weight sync: one message per 32 MB bucket, not per tensor


class Replica:
    def __init__(self, spec, pipeline, device: str) -> None:
        members = [pipeline.model(m) for m in base_of(spec.model).split("+")]
        dims = members[0].dims
        weights = next((m.weights for m in members if m.weights), None)
        self.model = build_model(dims, spec.heads, seed=pipeline.workload.seed,
                                 weights=weights)
        self.lora = next((m.lora for m in members if m.lora is not None), None)
        if self.lora is not None and len(getattr(spec, "tp", ())) > 1:
            raise BackendError(f"model '{members[0].name}' trains LoRA adapters, which this "
                               "backend runs at tp = 1 only", members[0].span,
                               hint="pin the actor's stages to tp = 1 (place ... { tp = 1 })")
        if self.lora is not None:               # adapters train, the backbone is frozen
            from backends.torch_backend.lora import apply_lora
            apply_lora(self.model, self.lora, seed=pipeline.workload.seed)
        self.model = self.model.to(device)
        self.tp = tuple(getattr(spec, "tp", ()))
        if len(self.tp) > 1:                       # split before the optimizer sees the params
            from backends.torch_backend.distributed import shard_tp
            shard_tp(self.model, self.tp, device)
        self.version = 0
        self.engine = TorchEngine(self.model, device=device) if "lm" in spec.heads else None
        self.heads = TokenHeads(self.model)
        self.optimizer = None
        self.grad_clip = 1.0
        if spec.trainable:
            self.optimizer, self.grad_clip = _optimizer(self.model, members)
        else:
            self.model.requires_grad_(False)
        self.train_heads = self.heads
        if len(self.tp) > 1 and len(spec.world) > len(self.tp):
            from backends.torch_backend.distributed import average_over
            average_over(self.model.parameters(), dp_peers(spec.world, self.tp, spec.device))
        elif len(spec.world) > 1 and len(self.tp) <= 1:
            from backends.torch_backend.distributed import wrap_ddp
            self.train_heads = wrap_ddp(self.heads, spec.world, device)

    @property
    def sharded(self) -> bool:
        return len(self.tp) > 1


def dp_peers(world: tuple[int, ...], tp: tuple[int, ...], device: int) -> tuple[int, ...]:
    """The devices of ``world`` (dp blocks of len(tp)) holding the same shard as ``device``."""
    t = tp.index(device)
    return tuple(world[i + t] for i in range(0, len(world), len(tp)))


def collective_groups(replicas) -> list[tuple[int, ...]]:
    """Every tensor-parallel group and every data-parallel group of same-shard ranks, in one
    order (each rank creates them all, as torch requires)."""
    out = set()
    for r in replicas:
        if len(r.tp) > 1:
            out.add(tuple(r.tp))
            if len(r.world) > len(r.tp):
                out.update(dp_peers(r.world, r.tp, d) for d in r.tp)
    return sorted(out)


class Executor:
    def __init__(self, ctx, device: int) -> None:
        torch.set_num_threads(max(1, ctx.threads))
        self.ctx = ctx
        self.device_index = device
        self.device = _device_name(ctx, device)
        if ctx.spec_dir not in sys.path:
            sys.path.insert(0, ctx.spec_dir)            # python("module:fn") next to the spec
        self.rows = workload_rows(ctx.pipeline, ctx.spec_dir)
        groups = collective_groups(ctx.replicas)
        if groups:
            from backends.torch_backend.distributed import make_groups
            make_groups(groups)
        self.replicas = {r.model: self._replica(r) for r in ctx.replicas_on(device)}
        self.groups: dict[str, object] = {}         # model -> its weight-sync group (sender)
        self.streams: dict[tuple[str, int], object] = {}
        self.reward_fns: dict[str, object] = {}

    def _replica(self, spec):
        """A torch replica, or the vLLM engine serving a copy of its own (``spec.engine``)."""
        if not spec.engine:
            return Replica(spec, self.ctx.pipeline, self.device)
        from backends.vllm_backend.disaggregated import EngineReplica
        stage = next(c for c in self.ctx.pipeline.stages if c.kind is OpKind.GENERATE
                     and self.ctx.pipeline.model(c.target).name in base_of(spec.model).split("+"))
        seqs, frac, graph = self._concurrency(stage)
        return EngineReplica.start(spec, self.ctx.pipeline, self.device_index,
                                   use_cuda=self.device.startswith("cuda"), max_num_seqs=seqs,
                                   kv_fraction=frac, devices=self.ctx.num_devices,
                                   cuda_graph=graph)

    def _concurrency(self, stage) -> tuple[int, float, bool]:
        return _concurrency(self.ctx, stage)

    # --- one op ------------------------------------------------------------------------
    def run(self, call: OpCall, inputs: dict[str, list]) -> tuple[dict, dict]:
        replica = self.replicas.get(call.model) if call.model else None
        info = {"version_read": replica.version if replica and call.version >= 0 else -1}
        kind = call.kind
        if kind is OpKind.GENERATE:
            out, stats = self._generate(call, replica)
            if call.carry:               # the oldest version any token of the chunk came from
                info["version_read"] = out[self._stage(call).outputs[0]].version
        elif kind is OpKind.FORWARD:
            out, stats = self._forward(call, replica, inputs)
        elif kind is OpKind.SCORE:
            out, stats = self._score(call, inputs)
        elif kind is OpKind.COMPUTE:
            out, stats = self._compute(call, inputs)
        elif kind is OpKind.TRAIN:
            out, stats = self._train(call, replica, inputs)
        elif call.role == EXPORT:
            out, stats = {"weights": _export(replica)}, {}
        elif call.role == SEND:
            out, stats = {}, self._send(call, replica)
        elif call.role == RECV:
            sync = self.ctx.sync_of(base_of(call.model))
            out, stats = {}, replica.receive(sync, call.writes, host=self.device_index,
                                             background=self.device_index in sync.senders)
        else:
            _load(replica, inputs["weights"], call.writes)
            out, stats = {}, {}
        if kind in (OpKind.TRAIN, OpKind.SYNC_WEIGHTS) and replica is not None:
            info["version_written"] = replica.version if call.writes >= 0 else -1
        info["stats"] = stats
        return out, info

    def _stage(self, call: OpCall):
        return self.ctx.pipeline.stage(call.stages[0])

    def _send(self, call, replica) -> dict:
        """Version ``call.version`` of the trainer's weights into the vLLM engines serving
        copies of the model (``backends.vllm_backend.sync``): the first sender broadcasts,
        the trainer's other ranks gather their pieces of split parameters with it."""
        from backends.vllm_backend import sync as S
        from backends.vllm_backend.weights import DEFAULT_BUCKET_BYTES
        group = self.ctx.sync_of(call.model)
        state = replica.model.state_dict()
        if self.device_index != group.senders[0]:
            for _ in S.gather(state, S.bucket_plan(S.trainer_metas(state), DEFAULT_BUCKET_BYTES)):
                pass
            return {}
        if call.model not in self.groups:
            self.groups[call.model] = S.open_group(group.addr, 0, group.world, self.device)
        buckets, nbytes = S.send(self.groups[call.model], state, DEFAULT_BUCKET_BYTES,
                                 self.device)
        return {"bytes": nbytes, "buckets": buckets}

    def _generate(self, call, replica):
        """Device r of D streams responses r, r + D, ... of the step, as chunks r, r + D, ...

        With partial rollouts (``call.carry``) the device's engine also advances its share
        of the next ``carry`` steps' prompts, kept between steps (``generate_carried``)."""
        stage = self._stage(call)
        key = (call.op, call.step)
        shard = call.world
        if call.chunk < shard:
            w = self.ctx.pipeline.workload
            n = w.prompts * w.samples
            mine = np.arange(call.chunk % shard, n, shard)
            codec = self._codec()
            params = SamplingParams(
                max_new_tokens=int(stage.param("max_len", w.gen_len.max_len)),
                temperature=float(stage.param("temperature", 1.0)),
                top_p=float(stage.param("top_p", 1.0)), eos_id=codec.eos_id,
                seed=(w.seed * 1_000_003 + call.step) * 64 + call.chunk % shard,
                max_num_seqs=self._concurrency(stage)[0])
            engine = self._engine(stage, replica)
            if call.carry:
                if not hasattr(engine, "generate_carried"):
                    raise BackendError(f"stage '{stage.name}' must generate whole responses "
                                       f"with this engine, not carry them over {call.carry} "
                                       "step(s)", stage.span, hint="plan it with carry 0")
                cohorts = [Cohort(t, tuple(self._prompts(t, mine, codec)), attrs.evolve(
                    params, seed=params.seed * 128 + t - call.step))
                    for t in range(call.step, call.step + call.carry + 1)]
                stream = engine.generate_carried(cohorts, chunks=call.chunks // shard,
                                                 key=call.op)
            else:
                stream = engine.generate(self._prompts(call.step, mine, codec), params,
                                         chunks=call.chunks // shard)
            self.streams[key] = (stream, mine)
        stream, mine = self.streams[key]
        chunk = next(stream)
        chunk = attrs.evolve(chunk, prompt_index=mine[chunk.prompt_index])   # step-wide indices
        if call.chunk + shard >= call.chunks:
            self.streams.pop(key, None)
        names = stage.outputs
        out = {names[0]: chunk}
        if len(names) > 1:
            out[names[1]] = chunk.logprobs
        lengths = [len(r) for r in chunk.response_ids]
        if call.tp_group and call.tp_group[0] != self.device_index:
            return out, {}                          # tp rank > 0: rank 0 reports the chunk
        return out, {"tokens": int(sum(lengths)), "responses": len(lengths),
                     "finished": float(np.mean(chunk.finished)) if lengths else 0.0}

    def _prompts(self, step: int, mine: np.ndarray, codec) -> list[np.ndarray]:
        """Token ids of this device's share (``mine``) of step ``step``'s prompts."""
        rows = self._step_rows(step)
        w = self.ctx.pipeline.workload
        return [np.asarray(codec.prompt(rows[i]["prompt"], w.prompt_len, w.template), np.int64)
                for i in mine]

    def _step_rows(self, step: int) -> list[dict]:
        w = self.ctx.pipeline.workload
        return step_rows(self.rows, w.prompts, w.samples, w.seed, step, self.ctx.data)

    def _forward(self, call, replica, inputs):
        stage = self._stage(call)
        chunk = _rollout(inputs[stage.inputs[0]])
        model = self.ctx.pipeline.model(stage.target)
        what = {Head.LM: "logprobs", Head.VALUE: "values", Head.REWARD: "scores"}[model.head]
        temperature = float(self._gen_param("temperature", 1.0))
        value = forward_arrays(replica.model, chunk.prompt_ids, chunk.response_ids, what,
                               device=self.device, temperature=temperature)
        return {stage.outputs[0]: value}, {}

    def _score(self, call, inputs):
        stage = self._stage(call)
        chunk = _rollout(inputs[stage.inputs[0]])
        rows = self._step_rows(call.step)
        picked = [rows[i] for i in chunk.prompt_index]
        text = self._codec().decode
        responses = [text(r) for r in chunk.response_ids]
        scores = score_rows(self._reward_fn(stage.target), self.ctx.pipeline.reward(stage.target),
                            call.step, picked, responses)
        stats = {"reward_sum": float(scores.sum()), "reward_n": int(len(scores))}
        keep = self.ctx.pipeline.log.samples
        kept = [n for n, i in enumerate(chunk.prompt_index) if i < keep]
        if kept:                        # the step's first responses, for samples.jsonl
            stats["samples"] = [sample_row(int(chunk.prompt_index[n]), picked[n],
                                           responses[n], float(scores[n])) for n in kept]
        return {stage.outputs[0]: scores}, stats

    def _compute(self, call, inputs):
        stage = self._stage(call)
        data = {role: _concat(inputs[name]) for name, role in self._roles(stage.inputs)
                if name in inputs}
        if stage.function == "gae":
            a, r = adv.gae(data["scores"], data["values"], data.get("logprobs"),
                           data.get("ref_logprobs"), kl=float(stage.param("kl", 0.0)),
                           gamma=float(stage.param("gamma", 1.0)),
                           lam=float(stage.param("lam", 0.95)))
            out = {stage.outputs[0]: a}
            if len(stage.outputs) > 1:
                out[stage.outputs[1]] = r
            stats = {}
            if data.get("logprobs") is not None and data.get("ref_logprobs") is not None:
                diff = np.concatenate([np.asarray(x, np.float32) - np.asarray(y, np.float32)
                                       for x, y in zip(data["logprobs"], data["ref_logprobs"],
                                                       strict=True)])
                stats = {"kl_sum": float(diff.sum()), "kl_n": int(diff.size)}
            return out, stats
        groups = group_of(_rollout(inputs["responses"]).prompt_index,
                          self.ctx.pipeline.workload.samples)
        if stage.function in ("group_norm", "grpo_advantages"):
            a = adv.group_norm(data["scores"], groups)
        elif stage.function == "rloo":
            a = adv.rloo(data["scores"], groups)
        else:
            raise BackendError(f"compute function must be gae, group_norm or rloo, "
                               f"not {stage.function!r}", stage.span)
        return {stage.outputs[0]: a}, {}

    def _train(self, call, replica, inputs):
        stages = [self.ctx.pipeline.stage(s) for s in call.stages]
        chunk = _rollout(inputs["responses"] if "responses" in inputs
                         else inputs[stages[0].inputs[0]])
        data = {}
        for s in stages:
            for name, role in self._roles(s.inputs):
                if name in inputs and role not in data:
                    data[role] = _concat(inputs[name])
        behaviour = data.get("logprobs", chunk.logprobs)
        versions = [c.version for c in inputs.get("responses", [])] or [chunk.version]
        sel = np.arange(call.rank, len(chunk), call.world)      # this rank's shard

        def pick(xs):
            return None if xs is None else tuple(xs[i] for i in sel)

        batch = TrainBatch(pick(chunk.prompt_ids), pick(chunk.response_ids),
                           old_logprobs=pick(behaviour), advantages=pick(data.get("advantages")),
                           returns=pick(data.get("returns")), old_values=pick(data.get("values")),
                           ref_logprobs=pick(data.get("ref_logprobs")),
                           behaviour_version=min(versions))
        losses = [_loss_spec(s, shared=len(stages) > 1) for s in stages]
        stats = train_step(
            replica.train_heads, replica.optimizer, batch, losses, version=replica.version,
            minibatches=max(int(s.param("minibatches", 1)) for s in stages),
            epochs=max(int(s.param("epochs", 1)) for s in stages), grad_clip=replica.grad_clip,
            microbatches=max(self.ctx.plan.placement(s.name).microbatches for s in stages),
            normalize=any(loss.kind == "ppo_clip" for loss in losses),
            seed=self.ctx.pipeline.workload.seed * 7919 + call.step, device=self.device)
        replica.version += 1
        if call.writes >= 0 and replica.version != call.writes:
            raise BackendError(f"train op '{call.id}' must write version {call.writes}, "
                               f"not {replica.version}")
        if replica.engine is not None:
            replica.engine.version = replica.version
        stats["tokens"] = int(sum(len(r) for r in batch.response_ids))
        return {}, stats

    # --- helpers -----------------------------------------------------------------------
    def _roles(self, names):
        """Data names -> what they are, from the stage that produces them."""
        p = self.ctx.pipeline
        for name in names:
            src = p.producer(name)
            if src is None:
                continue
            idx = src.outputs.index(name)
            if src.kind is OpKind.GENERATE:
                yield name, ("responses", "logprobs")[min(idx, 1)]
            elif src.kind is OpKind.FORWARD:
                m = p.model(src.target)
                yield name, {Head.LM: "ref_logprobs" if m.frozen else "logprobs",
                             Head.VALUE: "values", Head.REWARD: "scores"}[m.head]
            elif src.kind is OpKind.SCORE:
                yield name, "scores"
            elif src.function == "gae":
                yield name, ("advantages", "returns")[min(idx, 1)]
            else:
                yield name, "advantages"

    def _codec(self):
        """Text <-> ids of the generating model: its folder's own tokenizer, or bytes."""
        for s in self.ctx.pipeline.stages:
            if s.kind is OpKind.GENERATE:
                return codec_for(self.ctx.pipeline.model(s.target).weights)
        return codec_for(None)

    def _gen_param(self, key, default):
        for s in self.ctx.pipeline.stages:
            if s.kind is OpKind.GENERATE:
                return s.param(key, default)
        return default

    def _reward_fn(self, name: str):
        if name not in self.reward_fns:
            r = self.ctx.pipeline.reward(name)
            try:
                fn = getattr(importlib.import_module(r.module), r.function)
            except (ImportError, AttributeError) as e:
                raise BackendError(f"reward '{name}' must name a function, and "
                                   f"{r.module}:{r.function} is not one ({e})", r.span) from e
            self.reward_fns[name] = fn
        return self.reward_fns[name]

    def evaluate(self, model: str, step: int) -> dict:
        """The eval block on this worker's replica of ``model`` (``backends.torch_backend.evaluate``)."""
        from backends.torch_backend.evaluate import evaluate
        return evaluate(self, model, step)

    def checkpoint(self, model: str, path: str, meta: dict) -> str:
        replica = self.replicas[model]
        if getattr(replica, "engine_copy", False):  # a vLLM engine's copy: version, no weights
            replica.checkpoint(path, meta)
            _save_carried(replica, path)
            return path
        whole = self._gather_whole(model, replica) if replica.sharded else None
        if replica.lora is not None:            # the adapters alone: the backbone is rebuilt
            from backends.torch_backend.lora import adapter_state
            whole = adapter_state(replica.model, replica.optimizer)
        save_checkpoint(replica.model, path, {**meta, "model": model,
                                              "version": replica.version}, replica.optimizer,
                        whole=whole)
        _save_carried(replica, path)
        return path

    def _gather_whole(self, model: str, replica) -> dict:
        """Whole weights and moments of a tensor-parallel replica, from every rank's pieces.

        The other ranks' pieces are read on their workers through Dask (no collective), so
        this works whether one rank checkpoints or all of them do at once.
        """
        from backends.torch_backend.distributed import join_pieces, pieces
        try:
            from distributed import get_client, get_worker
            get_worker()
        except (ImportError, ValueError):
            get_client = None
        if get_client is None:                  # not in a Dask worker: the ranks gather together
            from backends.torch_backend.distributed import full_state
            return {**full_state(replica.model), **_moments_whole(replica)}
        got = get_client().run(tp_pieces, model, replica.tp)
        by_device = {d: p for per in got.values() if per for d, p in per.items()}
        by_device[self.device_index] = _numpy_pieces(pieces(replica.model, replica.optimizer))
        missing = [d for d in replica.tp if d not in by_device]
        if missing:
            raise BackendError(f"checkpoint of '{model}' must read every tensor-parallel rank, "
                               f"and devices {missing} did not answer")
        return join_pieces([_torch_pieces(by_device[d]) for d in replica.tp])

    def restore(self, model: str, path: str) -> int:
        """Load a replica written by :meth:`checkpoint` (weights, optimizer state, version)."""
        replica = self.replicas[model]
        if getattr(replica, "engine_copy", False):
            version = replica.restore(path)
            _restore_carried(replica, path)
            return version
        meta = load_checkpoint(replica.model, path, replica.optimizer)
        replica.version = int(meta["version"])
        if replica.engine is not None:
            replica.engine.version = replica.version
        _restore_carried(replica, path)
        return replica.version

    def _engine(self, stage, replica):
        """The replica's torch engine, or its vLLM engine (synced to it) when the plan chose vLLM.

        The plan's placement decides (``engine = auto`` may have become vLLM there).
        """
        if getattr(replica, "engine_copy", False):   # a vLLM engine's own copy
            return replica.ready()
        if self.ctx.plan.placement(stage.name).engine is Engine.VLLM:
            from backends.vllm_backend.colocated import COLOCATED_OPTIONS, colocated_engine
            from backends.vllm_backend.engine import with_concurrency
            seqs, frac, graph = _concurrency(self.ctx, stage)
            return colocated_engine(replica, with_concurrency(
                COLOCATED_OPTIONS, seqs, frac, self.ctx.num_devices, graph))
        replica.engine.version = replica.version
        return replica.engine

    def shutdown(self) -> None:
        self.streams.clear()
        for r in self.replicas.values():
            if getattr(r, "engine_copy", False):
                r.shutdown()
                continue
            if getattr(r, "vllm_engine", None) is not None:
                from backends.vllm_backend.colocated import shutdown_colocated
                shutdown_colocated(r)
            if r.engine is not None:
                r.engine.shutdown()
        self.replicas.clear()


def _concurrency(ctx, stage) -> tuple[int, float, bool]:
    """(max_num_seqs, kv_fraction, cuda_graph) of a generate stage, as the cost model
    priced them (the plan's placement, else the stage's parameters)."""
    from rpeg.cost.generation import batching_of
    return batching_of(ctx.pipeline, ctx.plan.placement(stage.name))


CARRIED = "carried"           # a replica checkpoint's partial rollouts: carried.json + .safetensors


def _save_carried(replica, path: str) -> None:
    """Write the partial rollouts the replica's engines keep, so a resumed run continues
    the same responses (nothing is written when they keep none)."""
    states = tuple(s for e in (replica.engine, getattr(replica, "vllm_engine", None))
                   if e is not None and hasattr(e, "carried_state") for s in e.carried_state())
    if states:
        from pathlib import Path

        from rpeg.runtime.checkpoint_io import save_tree
        save_tree(Path(path), CARRIED, {"buffers": states})


def _restore_carried(replica, path: str) -> None:
    """The partial rollouts a checkpoint holds, into the replica's engines (none: they start
    afresh). A vLLM engine not started yet gets them when it starts."""
    from pathlib import Path
    states: tuple = ()
    if (Path(path) / f"{CARRIED}.json").exists():
        from rpeg.runtime.checkpoint_io import load_tree
        states = tuple(load_tree(Path(path), CARRIED)["buffers"])
    if replica.engine is not None:
        replica.engine.restore_carried(states)
    vllm = getattr(replica, "vllm_engine", None)
    if vllm is not None:
        vllm.restore_carried(states)
    else:
        replica.carried_restore = states


def tp_pieces(model: str, group: tuple[int, ...]) -> dict | None:
    """On a worker: its pieces of ``model`` when it holds a rank of the tp ``group``."""
    from backends.torch_backend.distributed import pieces
    from rpeg.runtime import worker as W
    ex = W._STATE.get("executor")
    replica = ex.replicas.get(model) if ex is not None else None
    if replica is None or replica.tp != tuple(group):
        return None
    return {ex.device_index: _numpy_pieces(pieces(replica.model, replica.optimizer))}


def _numpy_pieces(p: dict) -> dict:
    return {k: (t.numpy(), d) for k, (t, d) in p.items()}


def _torch_pieces(p: dict) -> dict:
    return {k: (torch.as_tensor(t), d) for k, (t, d) in p.items()}


def _moments_whole(replica) -> dict:
    out = {}
    if replica.optimizer is None:
        return out
    for name, p in replica.model.named_parameters():
        for key, val in replica.optimizer.state.get(p, {}).items():
            if torch.is_tensor(val) and val.dim() > 0:
                out[f"{name}::{key}"] = (val.full_tensor() if hasattr(val, "full_tensor")
                                         else val).detach().cpu()
    return out


def _device_name(ctx, device: int) -> str:
    if ctx.use_cuda and torch.cuda.is_available():
        return f"cuda:{device % torch.cuda.device_count()}"
    return "cpu"


def _optimizer(model, members):
    trainable = [m for m in members if m.optimizer is not None]
    if not trainable:
        raise BackendError(f"model '{members[0].name}' is trained, so it must have an optimizer",
                           members[0].span, hint="add { optimizer = adam(lr = 1e-5) }")
    first = trainable[0].optimizer
    groups = [{"params": [p for n, p in model.named_parameters()
                          if not n.startswith("value_head") and p.requires_grad],
               "lr": first.lr}]
    value_opt = next((m.optimizer for m in trainable if m.head is not Head.LM), first)
    value_params = [p for n, p in model.named_parameters() if n.startswith("value_head")]
    if value_params:
        groups.append({"params": value_params, "lr": value_opt.lr})
    if first.kind not in ("adam", "adamw"):
        raise BackendError(f"optimizer must be adam or adamw, not {first.kind!r}",
                           trainable[0].span)
    cls = torch.optim.AdamW if first.kind == "adamw" else torch.optim.Adam
    opt = cls(groups, betas=tuple(first.betas), eps=first.eps, weight_decay=first.weight_decay)
    return opt, first.grad_clip


def _loss_spec(stage, shared: bool) -> LossSpec:
    loss = stage.param("loss")
    name = getattr(loss, "name", str(loss) if loss else "ppo_clip")
    args = getattr(loss, "args", ())
    clip = float(args[0]) if args else float(getattr(loss, "get", lambda *a: None)("clip") or 0.2)
    coef = float(stage.param("coef", 0.5 if (shared and name == "value_mse") else 1.0))
    return LossSpec(name, clip=clip, kl=float(stage.param("kl", 0.0)),
                    is_cap=float(stage.param("is_cap", 2.0)), coef=coef)


def score_rows(fn, reward, step: int, rows: list[dict], responses: list[str]) -> np.ndarray:
    """``fn(prompts, responses, answers, **columns)``, its scores checked
    (``rpeg.runtime.rewards``): the dataset's other columns reach the reward by name (each
    one its parameters name, or all of them for ``**kwargs``)."""
    extras = reward_extras(rows)
    params = inspect.signature(fn).parameters if callable(fn) else {}
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        extras = {k: v for k, v in extras.items() if k in params}
    return call_reward(fn, reward, step, [r["prompt"] for r in rows], responses,
                       [str(r.get("answer", "")) for r in rows], extras)


SAMPLE_CHARS = 4000             # a kept sample's prompt and response, each at most this long


def sample_row(index: int, row: dict, response: str, reward: float) -> dict:
    prompt = row["prompt"]
    prompt = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    out = {"index": index, "prompt": prompt[-SAMPLE_CHARS:], "response": response[:SAMPLE_CHARS],
           "reward": reward}
    if "answer" in row:
        out["answer"] = str(row["answer"])[:SAMPLE_CHARS]
    return out


def _rollout(parts) -> RolloutChunk:
    if len(parts) == 1:
        return parts[0]
    return RolloutChunk(
        prompt_index=np.concatenate([p.prompt_index for p in parts]),
        prompt_ids=tuple(x for p in parts for x in p.prompt_ids),
        response_ids=tuple(x for p in parts for x in p.response_ids),
        logprobs=tuple(x for p in parts for x in p.logprobs),
        finished=np.concatenate([p.finished for p in parts]),
        version=min(p.version for p in parts))


def _concat(parts):
    if isinstance(parts[0], RolloutChunk):
        return _rollout(parts)
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    return tuple(x for p in parts for x in p)


def _export(replica) -> list[tuple]:
    """Parameters packed into flat float32 buckets of about BUCKET_BYTES each, with the
    dimension each was cut along (None: whole); a sharded replica exports its own shards."""
    from backends.torch_backend.distributed import shard_state
    buckets, names, shapes, dims, parts, size = [], [], [], [], [], 0
    state = shard_state(replica.model)
    if replica.lora is not None:                # adapter-only sync: the backbone never changes
        from backends.torch_backend.lora import adapter_names
        keep = set(adapter_names(replica.model))
        state = {k: v for k, v in state.items() if k in keep}
    for name, (t, dim) in state.items():
        a = t.detach().to("cpu", torch.float32).numpy().ravel()
        names.append(name)
        shapes.append(tuple(t.shape))
        dims.append(dim)
        parts.append(a)
        size += a.nbytes
        if size >= BUCKET_BYTES:
            buckets.append((tuple(names), tuple(shapes), tuple(dims), np.concatenate(parts)))
            names, shapes, dims, parts, size = [], [], [], [], 0
    if parts:
        buckets.append((tuple(names), tuple(shapes), tuple(dims), np.concatenate(parts)))
    return buckets


def _unpack(buckets):
    for names, shapes, dims, flat in buckets:
        off = 0
        for name, shape, dim in zip(names, shapes, dims, strict=True):
            n = int(np.prod(shape)) if shape else 1
            yield name, (torch.from_numpy(flat[off:off + n].reshape(shape)), dim)
            off += n


def _load(replica, exports: list, version: int) -> None:
    """Load whole weights joined from the exports of every rank of the trainer's tp group."""
    from backends.torch_backend.distributed import join_shards, load_full

    def tensors():
        for items in zip(*(_unpack(b) for b in exports), strict=True):
            yield items[0][0], join_shards([piece for _, piece in items])
    if replica.sharded:
        load_full(replica.model, tensors())
    elif replica.engine is not None:
        replica.engine.update_weights(tensors(), version)
    else:
        own = replica.model.state_dict()
        with torch.no_grad():
            for name, value in tensors():
                own[name].copy_(value)
    replica.version = version
    if replica.engine is not None:
        replica.engine.version = version
