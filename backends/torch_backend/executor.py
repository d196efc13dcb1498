"""The torch backend's side of an op call: model state per worker, and what each op does.

    >>> ex = Executor(ctx, device=0)          # once per worker, at set-up  # doctest: +SKIP
    >>> outputs, info = ex.run(call, {"responses": [chunk]})                # doctest: +SKIP
    >>> info["version_read"]                                                # doctest: +SKIP
    3

The runtime (``rpeg.runtime.dask.worker``) times the call and records the trace
event; this module does the tensor work. Data in and out is plain numpy and
``RolloutChunk`` values. Each replica's ``version`` counts the optimizer steps
its weights have seen, and is what the trace reports as the version read; under
partial rollouts (``call.carry``) a generate op reports its chunk's oldest token's
version instead (the engine keeps the next steps' responses between steps).
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from backends.api import (
    Cohort,
    EngineCopy,
    RolloutChunk,
    SamplingParams,
    concat_chunks,
    select_chunk,
)
from backends.torch_backend import checkpoints, sampling
from backends.torch_backend.advantages import (
    Batch,
    at_policy_tokens,
    group_mean,
    policy_only,
)
from backends.torch_backend.algorithms import implementation, implements
from backends.torch_backend.checkpoints import carried_states
from backends.torch_backend.losses import LossSpec, adapt_kl
from backends.torch_backend.optim import set_lr
from backends.torch_backend.replica import Replica
from backends.torch_backend.rewards import Texts, score, scored
from backends.torch_backend.rows import SAMPLE_CHARS, row_prompt, sample_row
from backends.torch_backend.tokenizer import codec_for
from backends.torch_backend.train import NonFiniteUpdate, TrainBatch, forward_arrays, train_step
from rpeg.cost.partial import step_budget
from rpeg.errors import BackendError, RuntimeFailure
from rpeg.graph.work import Batching, work_of
from rpeg.plan.oplayout import block_rounds, fused_train
from rpeg.runtime.data import answer_of, workload_rows
from rpeg.runtime.lowering.context import group_of
from rpeg.runtime.lowering.instances import LOAD, RECV, SEND, OpCall, base_of, engine_key
from rpeg.runtime.rundir.lengths import histogram
from rpeg.spec.functions import function
from rpeg.spec.model import Engine, Head, OpKind, Reward
from rpeg.spec.registry import Category, Role
from rpeg.spec.stages import refill_scores, roles_of


class Executor:
    def __init__(self, ctx, device: int) -> None:
        torch.set_num_threads(max(1, ctx.threads))
        self.ctx = ctx
        self.device_index = device
        self.device = _device_name(ctx, device)
        if self.device.startswith("cuda"):          # before any tensor or engine is made
            torch.cuda.set_device(self.device)
        self.rows = workload_rows(ctx.pipeline)
        # each stage's settings (how it samples, its loss, its weight, its batching), as the
        # graph reads them: an engine copy built below starts with its stage's batching
        self.works = {s.name: work_of(ctx.pipeline, s.name) for s in ctx.pipeline.stages}
        if ctx.groups and torch.distributed.is_initialized():   # none in one process
            from backends.torch_backend.distributed import make_groups
            make_groups(ctx.groups)
        self.replicas = {r.model: self._replica(r) for r in ctx.replicas_on(device)}
        self.groups: dict[str, object] = {}         # model -> its weight-sync group (sender)
        self.streams: dict[tuple[str, int], object] = {}
        self.peers: dict[int, Executor] = {}       # an in-process run: every device's executor
        self.transferred: set[tuple[str, int]] = set()
        p = ctx.pipeline
        self.targets = {m.name: m for m in p.models} | {r.name: r for r in p.rewards}
        self.roles = roles_of(p.stages, self.targets)      # data name -> what it is
        self.sandbox = None                # tool calls' sandbox, started by the first

    def _replica(self, spec):
        """A torch replica, or the vLLM engine serving a copy of its own (``spec.engine``)."""
        if not spec.engine:
            return Replica(spec, self.ctx.pipeline, self.device, self.device_index)
        from backends.vllm_backend.disaggregated import EngineReplica
        seqs, frac, graph = self._concurrency(spec.serves)
        return EngineReplica.start(spec, self.ctx.pipeline, self.device_index,
                                   gpus=self._gpus(spec.engine), max_num_seqs=seqs,
                                   kv_fraction=frac, devices=self.ctx.num_devices,
                                   cuda_graph=graph, sleep=self._sleeps(spec.engine),
                                   build_on=self.device)

    def _gpus(self, block: tuple[int, ...]) -> str:
        """On CUDA, the GPUs of an engine's devices as their node names them, this worker's
        first (whatever each worker sees itself: ``rpeg.runtime.dask.devices``); "" on CPU."""
        if not self.ctx.use_cuda:
            return ""
        from rpeg.runtime.dask.devices import block_gpus
        return block_gpus(self.ctx.gpus, tuple(block))

    def _sleeps(self, block) -> bool:
        """Whether an engine on ``block`` sleeps between its generate calls: on GPUs it
        shares with a trainer (``rpeg.cost.engine_sync.engine_sleeps``, as priced)."""
        from rpeg.cost.engine_sync import engine_sleeps
        trained = {r.device for r in self.ctx.replicas if r.trainable}
        return engine_sleeps(block, trained, devices_are_host=not self.ctx.use_cuda)

    def _concurrency(self, op: str) -> tuple[int, float, bool]:
        """(max_num_seqs, kv_fraction, cuda_graph) of the generate op an engine serves
        (:attr:`Replica.serves`), as the cost model priced them (the plan's placement, else
        the stage's own batching)."""
        from rpeg.cost.generation import batching_of
        work = self.works[op]
        return batching_of(Batching(work.max_num_seqs, work.kv_fraction),
                           self.ctx.plan.placement(op))

    # --- one op ------------------------------------------------------------------------
    def run(self, call: OpCall, inputs: dict[str, list]) -> tuple[dict, dict]:
        replica = self.replicas.get(call.model) if call.model else None
        info = {"version_read": replica.version if replica and call.version >= 0 else -1}
        kind = call.kind
        if kind is not OpKind.SYNC_WEIGHTS:
            # the registry's function of the op's stage, by its implementation here
            fn = function(self._stage(call).function)
            op = implementation(fn.name) if fn.category is Category.STAGE else _estimate
            if call.parts:         # a pass split over its blocks: this block's part
                inputs = {k: [_part(_concat(v), call.chunk, call.parts)]
                          for k, v in inputs.items()}
            out, stats = op(self, call, replica, inputs)
            if kind is OpKind.GENERATE and call.carry:    # the oldest version of the chunk
                info["version_read"] = out[self._stage(call).outputs[0]].version
        elif call.role == SEND:
            out, stats = {}, self._send(call, replica)
        elif call.role == RECV:
            sync = self.ctx.sync_of(base_of(call.model))
            out, stats = {}, (replica.loaded(call.writes) if self.device_index in sync.local
                              else replica.receive(sync, call.writes, host=self.device_index))
        else:
            out, stats = self._sync(call, replica), {}
        if kind in (OpKind.TRAIN, OpKind.SYNC_WEIGHTS) and replica is not None:
            info["version_written"] = replica.version if call.writes >= 0 else -1
        if self.device.startswith("cuda"):       # the device's peak during this op
            stats = {**stats, "peak_bytes": int(torch.cuda.max_memory_allocated(self.device))}
            torch.cuda.reset_peak_memory_stats(self.device)
        info["stats"] = stats
        return out, info

    def _stage(self, call: OpCall):
        return self.ctx.pipeline.stage(call.stages[0])

    def _send(self, call, replica) -> dict:
        """Version ``call.version`` of the trainer's weights into the vLLM engines serving
        copies of the model (``backends.vllm_backend.sync``): every sender reads the weights
        as held between ops (whole, or ZeRO-3's shards, gathered by all of them together),
        the first broadcasts them to the engines on devices of their own, and an engine on
        this device is loaded in process."""
        from backends.torch_backend.weights import check_gather, sent_weights
        from backends.vllm_backend import sync as S
        from backends.vllm_backend.weights import DEFAULT_BUCKET_BYTES
        sync = self.ctx.sync_of(call.model)
        state = dict(sent_weights(replica))    # never state_dict(): FSDP2 reshards for it
        check_gather(state.items(), sync.senders)
        group = None
        if self.device_index == sync.senders[0] and sync.engines:
            if call.model not in self.groups:
                self.groups[call.model] = S.open_group(sync.addr, 0, sync.world, self.device,
                                                       sync.timeout_s)
            group = self.groups[call.model]
        engine = self.replicas.get(engine_key(call.model)) \
            if self.device_index in sync.local else None
        if engine is not None:
            engine.begin_local()
        buckets, nbytes = S.send(group, state, DEFAULT_BUCKET_BYTES, self.device,
                                 loads=[engine.load_local] if engine is not None else [])
        if engine is not None:
            engine.commit_local(call.version)
        return {"bytes": nbytes, "buckets": buckets} \
            if group is not None or engine is not None else {}

    def _generate(self, call, replica):
        """Device r of D streams responses r, r + D, ... of the step, as chunks r, r + D, ...
        (dealt by ``sampling.positions``, the rule the cost model prices by).

        With partial rollouts (``call.carry``) the device's engine also advances its share
        of the next ``carry`` steps' prompts, kept between steps (``generate_carried``).
        With dynamic sampling (``refill_rounds``) a device generates whole groups (prompts
        r, r + D, ...) and refills the degenerate ones first (``sampling.refill``)."""
        stage = self._stage(call)
        key = (call.op, call.step)
        shard = call.world
        stats: dict = {}
        if call.chunk < shard:
            w = self.ctx.pipeline.workload
            work = self.works[stage.name]
            rounds, how = work.refill_rounds, work.sampling
            mine = sampling.positions(call.chunk % shard, shard, w, bool(rounds))
            codec = self._codec()
            params = SamplingParams(
                max_new_tokens=how.max_len, temperature=how.temperature, top_p=how.top_p,
                eos_id=codec.eos_id,
                seed=(w.seed * 1_000_003 + call.step) * 64 + call.chunk % shard,
                min_new_tokens=how.min_len,
                max_num_seqs=self._concurrency(stage.name)[0])
            engine = self._engine(stage, replica)
            pieces = block_rounds(call.chunks, shard, call.chunk % shard)
            tools = self._toolbox(call, stage, engine, mine, codec, params)
            talk = {"tools": tools} if tools is not None else {}
            if call.carry:
                if rounds or not hasattr(engine, "generate_carried"):
                    raise BackendError(f"stage '{stage.name}' must generate whole responses "
                                       f"here, not carry them over {call.carry} step(s)",
                                       stage.span, hint="plan it with carry 0")
                # a cohort started early advances by the share of the longest response
                # the cost model prices a step (conversations: whole turns, unpaced)
                paced = w.gen_len.max_len if tools is None else 0
                cohorts = [Cohort(t, tuple(self._prompts(t, mine, codec)), attrs.evolve(
                    params, seed=params.seed * 128 + t - call.step),
                    budget=step_budget(paced, call.carry, t - call.step))
                    for t in range(call.step, call.step + call.carry + 1)]
                stream = engine.generate_carried(cohorts, chunks=pieces, key=call.op, **talk)
            elif rounds:
                done = self._refill(call, stage, engine, params, mine, codec, rounds)
                stream, mine = iter(sampling.split(done.chunk, pieces)), None
                stats = {"refill_rounds": done.rounds, "groups_filtered": done.filtered,
                         "groups_checked": done.checked}
            else:
                stream = engine.generate(self._prompts(call.step, mine, codec), params,
                                         chunks=pieces, **talk)
            self.streams[key] = (stream, mine, tools)
        stream, mine, tools = self.streams[key]
        # the policy the responses were sampled from travels with them: every logprob of
        # them computed later (old policy, reference, trainer) is at this temperature
        chunk = attrs.evolve(next(stream),
                             temperature=self.works[stage.name].sampling.logprob_temperature)
        if tools is not None:                # what the conversations did for this chunk
            stats = {**stats, **tools.stats()}
        if mine is not None:
            chunk = attrs.evolve(chunk, prompt_index=mine[chunk.prompt_index])   # step-wide
        # this device's last chunk of the step (its block's last round)
        if call.chunk // shard + 1 >= block_rounds(call.chunks, shard, call.chunk % shard):
            self.streams.pop(key, None)
            engine = self._engine(stage, replica)
            if getattr(getattr(engine, "options", None), "sleep", False):
                stream.close()                       # its requests ended, then it sleeps
                engine.rest()
        names = stage.outputs
        out = {names[0]: chunk}
        if len(names) > 1:
            out[names[1]] = chunk.logprobs
        lengths = [len(r) for r in chunk.response_ids]
        if call.tp_group and call.tp_group[0] != self.device_index:
            return out, {}                          # tp rank > 0: rank 0 reports the chunk
        return out, {"tokens": chunk.policy_tokens(), "responses": len(lengths),
                     "finished": float(np.mean(chunk.finished)) if lengths else 0.0,
                     # single responses: their lengths, against the workload's gen_len
                     **({"lengths": histogram(lengths)} if tools is None else {}),
                     **token_versions(chunk), **stats}

    def _toolbox(self, call, stage, engine, mine, codec, params):
        """A multi-turn generate stage's conversations (``backends.turns``): the worker's
        sandbox (started once, with every tool of the pipeline), the stage's caps, the
        dataset row of each of this device's prompts. None for single responses."""
        conv = self.works[stage.name].conversation
        if conv is None:
            return None
        if not getattr(engine, "converses", False):
            raise BackendError(f"stage '{stage.name}' holds conversations with tools, which "
                               f"the {type(engine).__name__} does not run", stage.span,
                               hint="generate it with engine = torch")
        if len(call.tp_group) > 1:
            raise BackendError(f"stage '{stage.name}' holds conversations with tools, which "
                               "the torch engine runs at tp = 1", stage.span,
                               hint="pin it to tp = 1: place ... { tp = 1 }")
        w = self.ctx.pipeline.workload

        def row_of(cohort: int, index: int) -> dict:
            # a carried cohort is the step whose prompts it answers; without carrying, the
            # engine numbers its one cohort 0, and its prompts are this call's step's
            step = cohort if call.carry else call.step
            return sampling.rows_for(self.rows, w, step, mine[index:index + 1], self.ctx.data)[0]
        return self.toolbox(conv, codec, row_of, params.max_new_tokens)

    def toolbox(self, conv, codec, row_of, max_len: int):
        """A :class:`backends.turns.Toolbox` on this worker's sandbox (started once, with
        every tool of the pipeline)."""
        if self.sandbox is None:
            from rpeg.runtime.usercode.sandbox import Sandbox
            self.sandbox = Sandbox.start(self.ctx.pipeline.tools, slots=self.ctx.tool_slots)
        from backends.turns import Toolbox
        return Toolbox(self.sandbox, conv, codec, row_of, max_len)

    def _refill(self, call, stage, engine, params, mine, codec, rounds):
        """Dynamic sampling for this device's groups (see ``sampling``)."""
        w = self.ctx.pipeline.workload
        n = w.prompts * w.samples

        def generate(positions, rnd):
            prompts = [row_prompt(codec, r, w)
                       for r in sampling.rows_for(self.rows, w, call.step, positions + rnd * n,
                                                  self.ctx.data)]
            p = attrs.evolve(params, seed=params.seed + rnd * sampling.ROUND_SEED)
            got = sampling.concat(list(engine.generate(prompts, p, chunks=1)))
            return attrs.evolve(got, prompt_index=np.asarray(positions)[got.prompt_index])

        readers = refill_scores(self.ctx.pipeline.stages, stage)

        def combined(chunk):
            texts = self._texts(call.step, chunk, int(params.max_new_tokens))
            return sum(self.works[s.name].weight * score(self.ctx.pipeline.reward(s.target),
                                                         texts) for s in readers)
        return sampling.refill(mine, generate, combined, w.samples, n, rounds)

    def _prompts(self, step: int, mine: np.ndarray, codec) -> list[np.ndarray]:
        """Token ids of this device's share (``mine``) of step ``step``'s prompts."""
        w = self.ctx.pipeline.workload
        return [row_prompt(codec, r, w)
                for r in sampling.rows_for(self.rows, w, step, mine, self.ctx.data)]

    def _texts(self, step: int, chunk: RolloutChunk, budget: int) -> Texts:
        """What a reward sees of ``chunk``: its prompts, responses, answers and dataset rows."""
        picked = sampling.rows_for(self.rows, self.ctx.pipeline.workload, step,
                                   chunk.prompt_index, self.ctx.data)
        text = self._codec().decode
        return Texts(tuple(r["prompt"] for r in picked),
                     tuple(text(r) for r in chunk.response_ids),
                     tuple(answer_of(r) for r in picked),
                     tuple(len(r) for r in chunk.response_ids), budget, tuple(picked), step)

    def _forward(self, call, replica, inputs):
        stage = self._stage(call)
        chunk = _rollout(inputs[stage.inputs[0]])
        model = self.ctx.pipeline.model(stage.target)
        what = {Head.LM: "logprobs", Head.VALUE: "values", Head.REWARD: "scores"}[model.head]
        place = self.ctx.plan.placement(stage.name)
        if call.world > 1:          # on its trainer's ZeRO-3 shards, with every rank of it
            from backends.torch_backend.gathered import forward_on_shards
            value = forward_on_shards(replica.trained, chunk.prompt_ids, chunk.response_ids,
                                      what, rank=call.rank, world=call.world,
                                      device=self.device, temperature=chunk.temperature,
                                      microbatches=place.microbatches, packed=place.packing)
        else:
            value = forward_arrays(replica.model, chunk.prompt_ids, chunk.response_ids, what,
                                   device=self.device, temperature=chunk.temperature,
                                   microbatches=place.microbatches, packed=place.packing)
        return {stage.outputs[0]: value}, {}

    def _score(self, call, replica, inputs):
        stage = self._stage(call)
        chunk = _rollout(inputs[stage.inputs[0]])
        target = self.targets[stage.target]
        if not isinstance(target, Reward):                  # a model with head = reward
            scores = forward_arrays(replica.model, chunk.prompt_ids, chunk.response_ids,
                                    "scores", device=self.device)
            texts = None
        else:
            texts = self._texts(call.step, chunk, self._longest(stage.inputs[0]))
            scores, failed = scored(target, texts)
        scores = np.asarray(scores, dtype=np.float32)
        stats = {f"reward_sum.{stage.name}": float(scores.sum()),
                 f"reward_n.{stage.name}": int(len(scores))}
        if texts is not None and target.on_error == "zero":   # recorded when declared
            stats[f"reward_errors.{stage.name}"] = failed
        keep = self.ctx.pipeline.log.samples
        kept = [n for n, i in enumerate(chunk.prompt_index) if i < keep]
        if kept and texts is not None:      # the step's first responses, for samples.jsonl
            stats["samples"] = [sample_row(int(chunk.prompt_index[n]), texts.rows[n],
                                           texts.responses[n], float(scores[n]))
                                | self._turns(chunk, n, stage.inputs[0]) for n in kept]
        return {stage.outputs[0]: scores}, stats

    def _turns(self, chunk: RolloutChunk, n: int, responses: str) -> dict:
        """A conversation's turns, for its row of samples.jsonl ({} for a single response)."""
        if chunk.masks is None:
            return {}
        from backends.turns import turns_of
        src = self.ctx.pipeline.producer(responses)
        conv = self.works[src.name].conversation if src is not None else None
        observer = "environment" if conv is not None and conv.environment else "tool"
        versions = chunk.versions[n] if chunk.versions is not None else \
            np.full(len(chunk.response_ids[n]), chunk.version)
        return {"turns": turns_of(chunk.response_ids[n], chunk.masks[n], versions,
                                  self._codec().decode, observer, SAMPLE_CHARS)}

    def _budget(self, responses: str) -> int:
        """The generation budget (max_len) of the stage that made ``responses``: of a
        conversation, its turns' (max_turns x max_len policy tokens)."""
        src = self.ctx.pipeline.producer(responses)
        if src is None or src.kind is not OpKind.GENERATE:
            return int(self.ctx.pipeline.workload.gen_len.max_len)
        work = self.works[src.name]
        turns = work.conversation.max_turns if work.conversation is not None else 1
        return work.sampling.max_len * turns

    def _longest(self, responses: str) -> int:
        """The most tokens a response of ``responses`` may have, what a reward's length is
        measured against: its stage's max_len, or a conversation's max_total_len (its
        policy's and observations' tokens together, as its length counts them)."""
        src = self.ctx.pipeline.producer(responses)
        if src is not None and src.kind is OpKind.GENERATE:
            conv = self.works[src.name].conversation
            if conv is not None:
                return int(conv.max_total_len)
        return self._budget(responses)

    def _estimator_batch(self, stage, inputs) -> tuple[Batch, dict]:
        """An estimator's inputs by role: the scores of its score stages added up with their
        weights, the responses' groups and lengths, the per-token inputs it reads."""
        est = self.works[stage.name].estimator     # its settings, read off the stage once
        p = self.ctx.pipeline
        baseline_of = est.baselines
        apart = set(baseline_of) | {p.producer(n).inputs[0] for n in baseline_of}
        by_role: dict[Role, list[str]] = {}
        for name in inputs:
            if name not in apart:
                by_role.setdefault(self.roles[name], []).append(name)
        scores = sum(self._weight(name) * np.asarray(_concat(inputs[name]), np.float64)
                     for name in by_role[Role.SCORES])
        w = self.ctx.pipeline.workload

        def one(role):
            names = by_role.get(role)
            return _concat(inputs[names[0]]) if names else None
        resp = one(Role.RESPONSES)
        values, logprobs, ref = one(Role.VALUES), one(Role.LOGPROBS), one(Role.REF_LOGPROBS)
        per_token = next((x for x in (values, logprobs, ref) if x is not None), None)
        lengths = tuple(len(r) for r in resp.response_ids) if resp is not None else \
            tuple(len(x) for x in per_token) if per_token is not None else ()
        groups = group_of(resp.prompt_index, w.samples) if resp is not None else None
        baseline = None
        if baseline_of:
            name = baseline_of[0]
            greedy = _rollout(inputs[p.producer(name).inputs[0]])
            base = np.asarray(_concat(inputs[name]), np.float64)
            own = group_of(greedy.prompt_index, w.samples)
            means = dict(zip(own.tolist(), group_mean(base, own).tolist(), strict=True))
            baseline = np.array([means[g] for g in groups.tolist()])
        args = dict(est.args)
        batch = Batch(np.asarray(scores, np.float32), lengths, groups, values, logprobs, ref,
                      baseline)
        masks = self._masks(inputs)
        return (policy_only(batch, masks) if masks is not None else batch), args, masks

    def _masks(self, inputs) -> tuple | None:
        """The policy-token masks of the conversations an op's inputs are about (None: single
        responses): those of the responses it reads, or that its inputs were made from."""
        for name in inputs:
            if self.roles.get(name) is Role.RESPONSES:
                return _concat(inputs[name]).masks
        return None

    def _weight(self, scores: str) -> float:
        return self.works[self.ctx.pipeline.producer(scores).name].weight

    def _compute(self, call, inputs):
        stage = self._stage(call)
        batch, args, masks = self._estimator_batch(stage, inputs)
        outputs = implementation(stage.function)(batch, args)
        if masks is not None:
            outputs = at_policy_tokens(outputs, masks)
        out = dict(zip(stage.outputs, outputs, strict=False))
        stats = {"reward_sum": float(np.sum(batch.scores)), "reward_n": int(len(batch.scores))}
        if batch.logprobs is not None and batch.ref_logprobs is not None:
            diff = np.concatenate([np.asarray(x, np.float32) - np.asarray(y, np.float32)
                                   for x, y in zip(batch.logprobs, batch.ref_logprobs,
                                                   strict=True)] or [np.zeros(0)])
            stats |= {"kl_sum": float(diff.sum()), "kl_n": int(diff.size)}
        return out, stats

    def _train(self, call, replica, inputs):
        stages = [self.ctx.pipeline.stage(s) for s in call.stages]
        data = {}
        for s in stages:
            for name in s.inputs:
                role = self.roles[name]
                if name in inputs and role not in data:
                    data[role] = _concat(inputs[name])
        chunk = data[Role.RESPONSES]
        behaviour = data.get(Role.LOGPROBS, chunk.logprobs)
        responses = next(n for n in stages[0].inputs if self.roles[n] is Role.RESPONSES)
        versions = [c.version for c in inputs.get(responses, [])] or [chunk.version]

        def whole(xs):
            return None if xs is None else tuple(xs)

        # every data-parallel rank gets the whole batch and trains its token-balanced share
        batch = TrainBatch(whole(chunk.prompt_ids), whole(chunk.response_ids),
                           old_logprobs=whole(behaviour),
                           advantages=whole(data.get(Role.ADVANTAGES)),
                           returns=whole(data.get(Role.RETURNS)),
                           old_values=whole(data.get(Role.VALUES)),
                           ref_logprobs=whole(data.get(Role.REF_LOGPROBS)),
                           behaviour_version=min(versions), loss_mask=whole(chunk.masks),
                           temperature=chunk.temperature)
        losses = [self._loss(s, replica, shared=len(stages) > 1,
                             old_values=Role.VALUES in data) for s in stages]
        # a shared backbone's stages: one schedule, the one the cost model prices
        work, place = fused_train(tuple(self.works[s.name] for s in stages),
                                  tuple(self.ctx.plan.placement(s.name) for s in stages))
        steps = self.ctx.pipeline.workload.steps
        lr = set_lr(replica.optimizer, replica.optimizer_spec, replica.version, steps)
        replica.trained.before_step()
        try:
            stats = train_step(
                replica.train_heads, replica.optimizer, batch, losses, version=replica.version,
                minibatches=work.minibatches, epochs=work.epochs, grad_clip=replica.grad_clip,
                microbatches=place.microbatches,
                normalize=any(loss.whiten for loss in losses),
                seed=self.ctx.pipeline.workload.seed * 7919 + call.step, device=self.device,
                rank=call.rank, world=call.world, packed=place.packing,
                budget=float(self._budget(responses)))
        except NonFiniteUpdate as e:
            raise _non_finite(stages, e, call.step) from None
        replica.trained.after_step()
        stats = _over_ranks(replica, stats)      # the step's, not this rank's share of it
        stats["lr"] = lr
        self._adapt(stages, losses, replica, stats, len(chunk))
        replica.version += 1
        if call.writes >= 0 and replica.version != call.writes:
            raise BackendError(f"train op '{call.id}' must write version {call.writes}, "
                               f"not {replica.version}")
        if replica.engine is not None:
            replica.engine.version = replica.version
        return {}, stats

    def _sync(self, call, replica) -> dict:
        """A weight transfer's part on this device (once, by its first call here), then the
        version the call writes into its copy."""
        from backends.torch_backend.weights import transfer
        key = (call.op, call.step)
        if key not in self.transferred:
            self.transferred = {k for k in self.transferred if k[1] >= call.step - 2}
            self.transferred.add(key)
            transfer(call, self.replicas, self.device, _transfer_dtype(self, call),
                     peers=self.peers)
        if call.role == LOAD:
            replica.version = call.writes
            if replica.engine is not None:
                replica.engine.version = call.writes
        return {}

    def _loss(self, stage, replica, shared: bool, old_values: bool) -> LossSpec:
        loss = LossSpec.from_call(self.works[stage.name].loss, shared=shared,
                                  old_values=old_values)
        if loss.kl_target is not None:           # adaptive: the coefficient this step
            loss = attrs.evolve(loss, kl=replica.kl_coef.get(stage.name, loss.kl))
        return loss

    def _adapt(self, stages, losses, replica, stats, responses: int) -> None:
        """Move each adaptive KL coefficient by the step's measured KL (all ranks agree: the
        KL is averaged over the data-parallel ranks first)."""
        for s, loss in zip(stages, losses, strict=True):
            if loss.kl_target is None or "kl" not in stats:
                continue
            measured = stats["kl"]             # over every rank already (_over_ranks)
            replica.kl_coef[s.name] = adapt_kl(loss.kl, measured, loss.kl_target, responses,
                                               loss.kl_horizon)
            stats["kl_coef"] = replica.kl_coef[s.name]

    # --- helpers -----------------------------------------------------------------------
    def _codec(self):
        """Text <-> ids of the generating model: its folder's own tokenizer, or bytes."""
        for s in self.ctx.pipeline.stages:
            if s.kind is OpKind.GENERATE:
                return codec_for(self.ctx.pipeline.model(s.target).weights)
        return codec_for(None)

    def evaluate(self, model: str, step: int) -> dict:
        """The eval block on this worker's replica of ``model`` (``backends.torch_backend.evaluate``)."""
        from backends.torch_backend.evaluate import evaluate
        return evaluate(self, model, step)

    def carries(self, model: str) -> bool:
        """Whether the replica's engines keep partial rollouts a checkpoint must write."""
        return bool(carried_states(self.replicas[model]))

    def checkpoint(self, model: str, path: str, meta: dict) -> str:
        """Write the replica of ``model`` (``backends.torch_backend.checkpoints``)."""
        return checkpoints.checkpoint(self, model, path, meta)

    def restore(self, model: str, path: str) -> int:
        """Load a replica written by :meth:`checkpoint` (weights, optimizer state, version)."""
        return checkpoints.restore(self, model, path)

    def _engine(self, stage, replica):
        """The replica's torch engine, or its vLLM engine (synced to it) when the plan chose vLLM.

        The plan's placement decides (``engine = auto`` may have become vLLM there).
        """
        if isinstance(replica, EngineCopy):   # a vLLM engine's own copy
            return replica.ready()
        if self.ctx.plan.placement(stage.name).engine is Engine.VLLM:
            from backends.vllm_backend.colocated import colocated_engine, colocated_options
            from backends.vllm_backend.engine import with_concurrency
            seqs, frac, graph = self._concurrency(stage.name)
            model = self.ctx.pipeline.model(stage.target)
            options = colocated_options(model.dtype, self._gpus((self.device_index,)),
                                        self._sleeps((self.device_index,)))
            return colocated_engine(replica, with_concurrency(
                options, seqs, frac, self.ctx.num_devices, graph))
        replica.engine.version = replica.version
        return replica.engine

    def shutdown(self) -> None:
        self.streams.clear()
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None
        for r in self.replicas.values():
            if isinstance(r, EngineCopy):
                r.shutdown()
                continue
            if getattr(r, "vllm_engine", None) is not None:
                from backends.vllm_backend.colocated import shutdown_colocated
                shutdown_colocated(r)
            if r.engine is not None:
                r.engine.shutdown()
        self.replicas.clear()


# --- the stage functions of the registry, as this backend runs them ------------------------

@implements("generate")
def generate_op(ex: Executor, call, replica, inputs):
    return ex._generate(call, replica)


@implements("forward")
def forward_op(ex: Executor, call, replica, inputs):
    return ex._forward(call, replica, inputs)


@implements("score")
def score_op(ex: Executor, call, replica, inputs):
    return ex._score(call, replica, inputs)


@implements("train")
def train_op(ex: Executor, call, replica, inputs):
    return ex._train(call, replica, inputs)


def _estimate(ex: Executor, call, replica, inputs):
    """An advantage estimator: its inputs by role, then its implementation by name."""
    return ex._compute(call, inputs)


def _non_finite(stages, e: NonFiniteUpdate, step: int) -> RuntimeFailure:
    """The run's stop where a train op's gradient is not finite: before its update."""
    names = "+".join(s.name for s in stages)
    return RuntimeFailure(
        f"train stage '{names}' at step {step}: the gradient norm is {e.grad_norm} (loss "
        f"{e.loss}), so the update was not applied and the run stopped; the weights are "
        f"as its last checkpoint saved them", stages[0].span,
        hint="a NaN or infinite loss comes from the data or the hyperparameters (the "
             "optimizer's lr, the scale of the rewards); `rpeg run --resume RUN_DIR` then "
             "goes on from the last checkpoint")


def _over_ranks(replica, stats: dict[str, float]) -> dict[str, float]:
    """A train step's statistics over the devices training ``replica`` (DDP, FSDP2; a
    tensor-parallel group's ranks agree already), in one all-reduce: each rank reports its
    share of the step's loss terms times the ranks (``train_step``), so their mean is the
    step's; its ``tokens`` are its own, so their sum is the step's. On one device, as
    they are (the metrics took rank 0's share times the ranks as the step's: a policy loss
    of -0.10 where one device gave 0.016, the same update)."""
    import torch.distributed as dist
    layout = replica.trained.layout if replica.trained is not None else None
    if layout is None or layout.dp <= 1 or not dist.is_initialized():
        return stats
    from backends.torch_backend.distributed import group_of
    peers = layout.dp_peers(replica.device_index) if layout.tp_size > 1 else layout.world
    keys = sorted(stats)                       # every rank has the same keys, in one order
    t = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64,
                     device=replica.device)
    dist.all_reduce(t, group=group_of(tuple(peers)))
    total = dict(zip(keys, t.tolist(), strict=True))
    return {k: total[k] if k == "tokens" else total[k] / len(peers) for k in keys}


def _device_name(ctx, device: int) -> str:
    """This worker's device: its own GPU (``ctx.gpus``, ``rpeg.runtime.dask.devices``), or
    the CPU."""
    if ctx.use_cuda:
        return f"cuda:{ctx.gpus[device].index}"
    return "cpu"


def _rollout(parts) -> RolloutChunk:
    return concat_chunks(parts)


def token_versions(chunk: RolloutChunk) -> dict:
    """The versions the policy's tokens of ``chunk`` were sampled with, as a count per
    version (``rpeg verify`` checks each against the staleness bound)."""
    if chunk.versions is None:
        return {}
    flat = np.concatenate([np.asarray(v, np.int64) for v in chunk.versions] or
                          [np.zeros(0, np.int64)])
    flat = flat[flat >= 0]
    values, counts = np.unique(flat, return_counts=True)
    return {"token_versions": {str(int(v)): int(c) for v, c in zip(values, counts,
                                                                   strict=True)}}


def _concat(parts):
    if isinstance(parts[0], RolloutChunk):
        return _rollout(parts)
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    return tuple(x for p in parts for x in p)


def _part(whole, i: int, n: int):
    """Part ``i`` of ``n`` of ``whole`` (a batch of responses or of their per-response
    values): its sequences divided as evenly as can be, in order, the first parts one
    longer (``numpy.array_split``'s bounds). Never an empty one: the placed graph splits a
    step's batch into no more parts than it holds sequences
    (:func:`rpeg.plan.oplayout.split_parts` refuses a plan that would), and dynamic
    sampling refills the groups it filters rather than drop them (``sampling.refill``: a
    step's batch keeps its size), so a batch smaller than its parts is one the plan was not
    made for."""
    if n > len(whole):
        raise BackendError(f"a pass split into {n} parts must get at least {n} sequences, "
                           f"not {len(whole)}: part {i} would hold none, which the plan did "
                           "not price")
    size, extra = divmod(len(whole), n)
    lo = i * size + min(i, extra)
    hi = lo + size + (i < extra)
    if isinstance(whole, RolloutChunk):
        return select_chunk(whole, range(lo, hi))
    return whole[lo:hi]


def _transfer_dtype(ex, call):
    """The dtype weights travel in: the readers' parameter dtype."""
    from backends.torch_backend.sharding import param_dtype
    first = base_of(call.model).members[0]
    return param_dtype(ex.ctx.pipeline.model(first).dtype, ex.device)
