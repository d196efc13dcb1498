"""How engines batch, cache and communicate: each rule of the GPU cost model on a hand-made
case, against the simpler rule it replaced (every test fails on the model before it)."""

from __future__ import annotations

import attrs
import pytest

from rpeg.cost.engines import CONTROLLER_BYTES, EFFICIENCY, ENGINES, efficiency, engine_terms
from rpeg.cost.examples import ppo_pipeline, single_gpu_op
from rpeg.cost.generation import generate_memory, generation_rows, hybrid_merge_bytes
from rpeg.cost.memory import local_params, model_params, resident_memory
from rpeg.cost.passes import shape, train_cost, train_memory, train_phases
from rpeg.cost.profiles import builtin_profile, cluster_of
from rpeg.cost.stages import estimate_stage, stage_memory
from rpeg.cost.topology import Collective, Topology, collective_time
from rpeg.graph.layout import Layout, changed
from rpeg.graph.work import work_of
from rpeg.spec.model import Engine, Model
from rpeg.spec.presets import PRESETS

H100 = cluster_of("h100", 8)
R8 = tuple(range(8))


@pytest.fixture(scope="module")
def ppo():
    """Llama 3.1 8B, 512 prompts of 512 tokens, answers log-normal (median 256, max 4096)."""
    return ppo_pipeline("llama3.1-8b", prompts=512, prompt_len=512, gen_median=256,
                        gen_max=4096)


def test_a_paged_cache_holds_live_tokens_not_the_longest_response(ppo):
    par, model, w = Layout(dp=8), ppo.model("actor"), ppo.workload
    paged = generate_memory(model, par, w, H100.gpu, Engine.VLLM, 64, 64).kv_cache
    static = generate_memory(model, par, w, H100.gpu, Engine.HF, 64, 64).kv_cache
    # a running sequence holds its prompt and E[L^2] / 2E[L] generated tokens, far below
    # the 512 + 4096 a contiguous cache reserves
    assert paged < static / 4
    free = 40e9
    assert generation_rows(work_of(ppo, "rollout"), par, H100, free, engine=Engine.VLLM) > \
        generation_rows(work_of(ppo, "rollout"), par, H100, free, engine=Engine.HF)


def test_concurrency_is_the_engines_batch_bounded_by_memory(ppo):
    par = Layout(dp=8)
    assert generation_rows(work_of(ppo, "rollout"), par, H100, 1e12, engine=Engine.VLLM) == 64
    eight = changed(par, max_num_seqs=8)
    assert generation_rows(work_of(ppo, "rollout"), eight, H100, 1e12, engine=Engine.VLLM) == 8
    # fewer at once: more decode steps, each reading the weights again
    assert estimate_stage(work_of(ppo, "rollout"), eight, R8, H100, engine=Engine.VLLM, rows=8).time_s \
        > estimate_stage(work_of(ppo, "rollout"), par, R8, H100, engine=Engine.VLLM).time_s
    # a pinned share of the GPU is what the engine takes, whatever it caches
    share = changed(par, kv_fraction=0.5)
    m = stage_memory(work_of(ppo, "rollout"), share, H100, rows=8, engine=Engine.VLLM)
    weights = local_params(ppo.model("actor"), Layout()) * 2
    assert m.total == pytest.approx(0.5 * H100.gpu.memory - weights)


def test_a_static_batch_decodes_until_its_longest_response(ppo):
    par = Layout(dp=8)
    keeps = estimate_stage(work_of(ppo, "rollout"), par, R8, H100, engine=Engine.HF)
    drops = estimate_stage(work_of(ppo, "rollout"), attrs.evolve(par), R8, H100, engine=Engine.TORCH)
    hf, torch = ENGINES[Engine.HF], ENGINES[Engine.TORCH]
    assert hf.static_batch and not torch.static_batch
    assert dict(keeps.breakdown)["decode"] > dict(drops.breakdown)["decode"] \
        * torch.layer_s / hf.layer_s


def test_generation_on_zero3_shards_gathers_the_weights_every_step(ppo):
    par = Layout(dp=8)
    plain = estimate_stage(work_of(ppo, "rollout"), par, R8, H100, engine=Engine.HF).time_s
    sharded = estimate_stage(work_of(ppo, "rollout"), attrs.evolve(par, zero=3), R8, H100,
                             engine=Engine.HF).time_s
    gather = collective_time(Collective.ALL_GATHER, model_params(ppo.model("actor")) * 2, R8,
                             Topology.from_cluster(H100))
    steps = ppo.workload.gen_len.max_len
    assert sharded - plain > steps * gather * (1 - ENGINES[Engine.HF].overlap) * 0.5


def test_the_hybrid_engine_gathers_the_whole_model_once_a_call_whatever_its_tp(ppo):
    """DeepSpeed's Hybrid Engine on ZeRO-3 shards (pinned parameters, its default): every
    rank gathers each layer's whole tensors once a generate call and keeps its tensor-parallel
    slice, so the call's gather moves the whole model's bytes at tp 1 and tp 8 alike, and not
    once a decode step."""
    work, topo = work_of(ppo, "rollout"), Topology.from_cluster(H100)
    actor, gpu = ppo.model("actor"), H100.gpu
    full = collective_time(Collective.ALL_GATHER, model_params(actor) * 2, R8, topo)
    for par in (Layout(dp=8), Layout(dp=1, tp=8)):
        z3 = attrs.evolve(par, zero=3)
        plain = estimate_stage(work, par, R8, H100, engine=Engine.HYBRID)
        sharded = estimate_stage(work, z3, R8, H100, engine=Engine.HYBRID)
        # beside the gather, each forward's weight copies (hybrid_merge_bytes)
        merge = hybrid_merge_bytes(actor, z3, gpu) * actor.dims.layers / gpu.mem_bandwidth
        assert dict(sharded.breakdown)["prefill"] - dict(plain.breakdown)["prefill"] \
            == pytest.approx(full + merge)
        extra = dict(sharded.breakdown)["decode"] - dict(plain.breakdown)["decode"]
        assert 0 < extra <= ppo.workload.gen_len.max_len * merge * (1 + 1e-9)


def test_the_hybrid_engine_on_zero3_copies_split_weights_every_forward(ppo):
    """On ZeRO-3 the Hybrid Engine keeps q/k/v and a gated MLP's gate/up as separate tensors
    and merges them into one buffer every forward (DeepSpeed's ds_attention._merge_qkv,
    ds_mlp._merge_inter_w): read and written once more a pass, its slice per tp rank; without
    ZeRO-3 they are fused once."""
    actor, gpu = ppo.model("actor"), H100.gpu
    d = actor.dims
    assert hybrid_merge_bytes(actor, Layout(dp=8), gpu) == 0.0
    one = hybrid_merge_bytes(actor, Layout(dp=8, zero=3), gpu)
    assert one == 2 * (d.hidden * (d.q_dim + 2 * d.kv_dim) + 2 * d.hidden * d.ffn) * 2
    assert hybrid_merge_bytes(actor, Layout(dp=1, tp=8, zero=3), gpu) == pytest.approx(one / 8)


def test_vllm_pays_its_host_time_per_running_sequence(ppo):
    """vLLM's step beside its fixed part costs vllm_seq_s a running sequence (V0's per-
    sequence Python); no other engine has the term."""
    assert ENGINES[Engine.VLLM].seq_s == EFFICIENCY.vllm_seq_s > 0
    assert all(ENGINES[e].seq_s == 0 for e in ENGINES if e is not Engine.VLLM)
    work, par = work_of(ppo, "rollout"), Layout(dp=8)
    fast = estimate_stage(work, par, R8, H100, engine=Engine.VLLM).time_s
    with efficiency(attrs.evolve(EFFICIENCY, vllm_seq_s=100e-6)):
        slow = estimate_stage(work, par, R8, H100, engine=Engine.VLLM).time_s
    assert slow > fast


def test_zero3_training_gathers_in_every_micro_batch(ppo):
    topo, model, w = Topology.from_cluster(H100), ppo.model("actor"), ppo.workload
    one, eight = (dict(train_cost(model, Layout(dp=8, zero=3, microbatches=m), R8, topo,
                                  H100.gpu, Engine.DEEPSPEED, w, 512, 1024.0,
                                  opt_steps=1).breakdown)["zero3_gather"] for m in (1, 8))
    assert eight > 6 * one


def test_zero_2_and_3_buckets_are_not_the_whole_gradient(ppo):
    model, w = ppo.model("actor"), ppo.workload
    grads = local_params(model, Layout(dp=8)) * 2
    # the buckets live in the backward pass, whichever phase holds the step's peak
    ddp = train_phases(model, Layout(dp=8), H100.gpu, Engine.TORCH, w, 512, 1024.0, 1)[1]
    z3 = train_phases(model, Layout(dp=8, zero=3), H100.gpu, Engine.TORCH, w, 512, 1024.0,
                      1)[1]
    assert ddp.buffers - z3.buffers > 0.8 * grads


def test_a_train_steps_peak_is_its_larger_phase_not_their_sum():
    # Qwen2.5-7B's 152k-token vocabulary: the logits the loss reads are alive before the
    # backward pass makes its gradients, gathers layers and fills buckets, never with them
    # (measured on CPU workers: benchmarks/train_executor.py's vocabulary model)
    p = ppo_pipeline("qwen2.5-7b", prompts=64, prompt_len=512, gen_median=512, gen_max=2048)
    model, w = p.model("actor"), p.workload
    par = Layout(dp=8, zero=3, recompute=True)
    at_loss, backward = train_phases(model, par, H100.gpu, Engine.TORCH, w, 512, 1024.0, 1)
    peak = train_memory(model, par, H100.gpu, Engine.TORCH, w, 512, 1024.0, 1)
    assert peak == max(at_loss, backward, key=lambda m: m.total)
    assert at_loss.grads == 0 < backward.grads              # one micro-batch: none made yet
    assert at_loss.buffers > backward.buffers               # the logits
    # a second micro-batch's loss holds the gradients the first one made
    two = train_phases(model, attrs.evolve(par, microbatches=2), H100.gpu, Engine.TORCH, w,
                       512, 1024.0, 1)[0]
    assert two.grads == backward.grads


def test_recomputation_holds_the_recomputed_layer_beside_the_gradients(ppo):
    # 8 and 16 rows a GPU: the layers' kept inputs (3-6 GB) are under the 16 GB of bf16
    # gradients the backward pass makes while freeing them, but the layer it recomputes is
    # held whole beside them, so the step's activations grow with its tokens
    model, w, par = ppo.model("actor"), ppo.workload, Layout(dp=8, recompute=True)
    one, two = (train_memory(model, par, H100.gpu, Engine.TORCH, w, b, 1024.0, 1)
                for b in (64, 128))
    assert one.grads > 3 * one.activations > 0
    assert two.activations == pytest.approx(2 * one.activations)


def test_packed_sequences_cost_their_real_lengths(ppo):
    par = Layout(dp=8, microbatches=4)
    padded = estimate_stage(work_of(ppo, "ref_lp"), par, R8, H100).time_s
    packed = estimate_stage(work_of(ppo, "ref_lp"), attrs.evolve(par, packing=True), R8, H100).time_s
    assert packed < padded / 3         # mean answer ~300 tokens, padded to ~4000


def test_cuda_graphs_replace_the_per_layer_launches():
    # a small model, whose decode steps the host's launches bound (an 8B model's are bound
    # by reading its weights, which a graph does not shorten)
    small = ppo_pipeline("qwen2.5-0.5b", prompts=512, prompt_len=512, gen_median=256,
                         gen_max=4096)
    par = Layout(dp=8)
    eager = estimate_stage(work_of(small, "rollout"), par, R8, H100, engine=Engine.VLLM).time_s
    graph = estimate_stage(work_of(small, "rollout"), changed(par, cuda_graph=True), R8,
                           H100, engine=Engine.VLLM).time_s
    assert graph < eager


def test_engine_terms_are_the_same_on_every_gpu_kind():
    for engine in ENGINES:
        terms = {engine_terms(engine, builtin_profile(g))
                 for g in ("a100", "a800", "h100", "h20", "h200", "b200")}
        assert len(terms) == 1, engine


def test_experts_all_held_but_only_the_active_ones_computed():
    moe = PRESETS["qwen3-30b-a3b"]
    m = Model("actor", "qwen3-30b-a3b", moe)
    held = resident_memory(m, Layout(tp=1), H100, trained=False).weights
    assert held == pytest.approx(moe.param_count() * 2)
    p = ppo_pipeline("qwen3-30b-a3b", prompts=64, prompt_len=1024, gen_median=512, gen_max=512)
    dense = ppo_pipeline("qwen3-32b", prompts=64, prompt_len=1024, gen_median=512, gen_max=512)
    assert estimate_stage(work_of(p, "ref_lp"), Layout(), (0,), H100).time_s < \
        estimate_stage(work_of(dense, "ref_lp"), Layout(), (0,), H100).time_s / 4
    # expert parallelism splits the experts: 1/8 of them on a GPU with ep = 8
    assert local_params(m, Layout(dp=8, ep=8)) < local_params(m, Layout(dp=8)) / 4


def test_all_to_all_across_nodes_pays_the_slower_link():
    topo = Topology.from_cluster(cluster_of("h100", 8, 2))
    inside = collective_time(Collective.ALL_TO_ALL, 1e9, tuple(range(8)), topo)
    across = collective_time(Collective.ALL_TO_ALL, 1e9, tuple(range(0, 16, 2)), topo)
    assert across > 5 * inside


@pytest.mark.parametrize("kind", ["forward", "train", "generate"])
def test_single_gpu_ops_grow_with_the_model(kind):
    times = [single_gpu_op(kind, m, batch=8, prompt_len=256, gen_len=128)
             for m in ("qwen2.5-0.5b", "qwen2.5-1.5b", "llama3.1-8b")]
    assert times == sorted(times) and times[0] > 0



def test_a_controller_charges_its_round_trip_and_the_batch_through_it(ppo):
    """Each op call a controller drives costs its round trip plus the batch's sequences
    (CONTROLLER_BYTES a token) at its rate: twice the batch, twice the bytes' share."""
    work, par, w = work_of(ppo, "ref_lp"), Layout(dp=8), ppo.workload
    driven = attrs.evolve(H100, controller=True)
    with efficiency(attrs.evolve(EFFICIENCY, call_s=5e-3, controller_rate=1e9)):
        plain = estimate_stage(work, par, R8, H100, engine=Engine.TORCH)
        one = estimate_stage(work, par, R8, driven, engine=Engine.TORCH)
        two = estimate_stage(work, par, R8, driven, engine=Engine.TORCH, batch=2 * w.batch)
    tokens = w.batch * (float(w.prompt_lens.quantiles().mean())
                        + float(w.gen_len.quantiles().mean()))
    charge = dict(one.breakdown)["control"]
    assert "control" not in dict(plain.breakdown)
    assert one.time_s == pytest.approx(plain.time_s + charge)
    assert charge == pytest.approx(5e-3 + tokens * CONTROLLER_BYTES / 1e9)
    assert dict(two.breakdown)["control"] - 5e-3 == pytest.approx(2 * (charge - 5e-3))


def _train_s(model, par, gpu, engine, w):
    topo = Topology.from_cluster(H100)
    return train_cost(model, par, (0,), topo, gpu, engine, w, 64, 256.0, opt_steps=1).compute_s


def _with_vocab(model, vocab):
    return attrs.evolve(model, dims=attrs.evolve(model.dims, vocab=vocab))


def test_the_torch_engines_log_probabilities_move_what_its_code_moves(ppo):
    """The torch engine's train step pays, per logit, the bytes its log-probabilities move
    forward and backward (LossTraffic: 44 and 72 in bf16) at the elementwise bandwidth,
    not backward_factor times the forward's; an engine not counted apart pays 12 a pass."""
    model, w = ppo.model("actor"), ppo.workload
    par = Layout(dp=1, microbatches=1)
    gpu = attrs.evolve(H100.gpu, elem_bandwidth=H100.gpu.mem_bandwidth)
    slow = attrs.evolve(gpu, elem_bandwidth=gpu.elem_bandwidth / 2)
    per_vocab = {}
    for engine in (Engine.TORCH, Engine.DEEPSPEED):
        # what halving the elementwise bandwidth adds, per vocabulary entry: the loss's
        # bytes per logit over the bandwidth, times the head's positions
        extra = [_train_s(_with_vocab(model, v), par, slow, engine, w)
                 - _train_s(_with_vocab(model, v), par, gpu, engine, w)
                 for v in (32_000, 160_000)]
        per_vocab[engine] = (extra[1] - extra[0]) / 128_000
    bw = gpu.elem_bandwidth
    tokens = shape(w, par, 64, 256.0).head_tokens
    torch = ENGINES[Engine.TORCH].loss
    assert per_vocab[Engine.TORCH] == pytest.approx(
        tokens * (torch.forward(2) + torch.backward(2)) / bw, rel=1e-6)
    assert per_vocab[Engine.DEEPSPEED] == pytest.approx(
        tokens * 12 * (1 + gpu.backward_factor) / bw, rel=1e-6)


def test_recomputation_runs_the_layers_again_not_the_head(ppo):
    """What recomputation adds to a train step does not grow with the vocabulary."""
    model, w = ppo.model("actor"), ppo.workload
    added = [_train_s(_with_vocab(model, v), Layout(dp=1, recompute=True), H100.gpu,
                      Engine.TORCH, w)
             - _train_s(_with_vocab(model, v), Layout(dp=1), H100.gpu, Engine.TORCH, w)
             for v in (32_000, 160_000)]
    assert added[0] > 0
    assert added[1] == pytest.approx(added[0], rel=1e-9)
