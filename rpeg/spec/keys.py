"""The registry of the blocks' keys: every key a workload, model, eval, log, place, cluster,
link or profile block accepts, once.

    >>> WORKLOAD.param("samples").default, WORKLOAD.param("samples").range_text()
    (1, '[1, 4096]')
    >>> "prompt_field" in WORKLOAD_BLOCK.keys, PLACE.param("recompute").applies
    (True, ('train',))

Each key is a :class:`~rpeg.spec.registry.Param` -- type, range, default, unit and
meaning -- as a function's keyword is in ``rpeg.spec.functions``. The checker refuses any
key a block's :class:`Section` does not name and reads the plain values through
:func:`read`, so the range a key is checked against is the one documented; ``rpeg help
TOPIC`` prints the sections (:mod:`rpeg.spec.topics`). A new key is one entry here, the
code that acts on it, and a witness that it changes what runs
(``tests/backends/test_every_key.py``).
"""

from __future__ import annotations

import attrs

from rpeg.errors import SpecError
from rpeg.spec import ast
from rpeg.spec import values as V
from rpeg.spec.functions import by_category
from rpeg.spec.kinds import GENERATE_ENGINES, PASS_ENGINES, Head, OpKind
from rpeg.spec.model import CHECKPOINT_EVERY, KEEP_CHECKPOINTS, DType, GpuProfile
from rpeg.spec.presets import Family
from rpeg.spec.registry import Category, Param, Type
from rpeg.spec.training import LORA_TARGETS, Template, Tracker, Truncation

MAX_STEPS = 10_000_000
MAX_TOKENS = 1 << 21
MAX_DIM = 1 << 22
MAX_GPU = 1 << 20


@attrs.frozen
class Section:
    """One block of the language: how it is written, and its keys."""

    name: str
    form: str                         # how the block is written
    doc: str
    params: tuple[Param, ...]

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def has(self, key: str) -> bool:
        return any(p.name == key for p in self.params)

    def param(self, key: str) -> Param:
        for p in self.params:
            if p.name == key:
                return p
        raise KeyError(f"{self.name} has no key {key!r}")

    def __add__(self, other: Section) -> Section:
        return attrs.evolve(self, params=self.params + other.params)


def _int(name: str, doc: str, low: int = 1, high: int = V.MAX_INT, **kw) -> Param:
    return Param(name, Type.INT, doc, low=low, high=high, **kw)


# --- the workload and its data --------------------------------------------------------------

WORKLOAD = Section(
    "workload", "workload { KEY = VALUE ... }",
    "What one step works on: how many prompts, how many responses each, how long they are. "
    "The cost model prices these lengths; the run reads its prompts from the data keys.",
    (_int("steps", "RL steps the run takes (rpeg run --steps N overrides it)",
          high=MAX_STEPS, required=True, unit="steps"),
     _int("prompts", "prompts per step", required=True, unit="prompts"),
     _int("samples", "responses per prompt (group estimators such as group_norm and rloo "
          "need at least 2)", high=4096, default=1, unit="responses"),
     Param("prompt_len", Type.LENGTH, "the longest prompt (longer ones are cut to it), or a "
           "distribution of prompt lengths whose max is that cut", unit="tokens", low=1,
           high=MAX_TOKENS, required=True, example="8"),
     Param("gen_len", Type.LENGTH, "the lengths responses come out at: what the cost model "
           "prices (a generate stage's max_len and min_len bound it)", unit="tokens", low=1,
           high=MAX_TOKENS, required=True, example="uniform(min = 1, max = 16)"),
     _int("seed", "seeds every random choice of the run (sampling, data order, initial "
          "weights), with the step", low=0, high=2**31 - 1, default=0),
     _int("checkpoint_every", "steps between the checkpoints a run writes (verl's "
          "trainer.save_freq, OpenRLHF's --save_steps): it cuts at every multiple, at every "
          "eval step and after the last step, and the cost model prices each save; 0: only "
          "at the eval steps and the end (a lost worker then fails the run). rpeg run "
          "--checkpoint-every N overrides it", low=0, high=MAX_STEPS,
          default=CHECKPOINT_EVERY, unit="steps"),
     _int("keep_checkpoints", "complete checkpoints a run keeps, the newest (verl's "
          "max_actor_ckpt_to_keep, Hugging Face's save_total_limit); an older one is deleted "
          "once a newer is complete; 0: every one (rpeg export --step reads any kept)",
          low=0, high=MAX_STEPS, default=KEEP_CHECKPOINTS, unit="checkpoints")))

DATA = Section(
    "data", "workload { dataset = \"FILE\"; prompt_field = \"...\"; ... }",
    "Where a run's prompts come from, written in the workload block. A dataset is a "
    "JSON-lines or Parquet file, or a folder saved by datasets' save_to_disk; columns "
    "other than the prompt and the answer reach a python reward by name.",
    (Param("dataset", Type.STRING, "the prompts' file or folder, relative to the folder of "
           "the file that names it (without one, a run generates from synthetic prompts)",
           example='"data/toy.jsonl"'),
     Param("prompt_field", Type.STRING, "the column holding the prompt", default="prompt",
           example='"question"'),
     Param("answer_field", Type.STRING, "the column holding the reference answer, passed to "
           "the reward as answers", default="answer", example='"solution"'),
     Param("template", Type.CHOICE, "how a prompt becomes tokens: auto (the tokenizer's chat "
           "template when it has one, else the text as it is), chat (always the template), "
           "raw (the text as it is)", default=Template.AUTO.value,
           choices=tuple(t.value for t in Template)),
     Param("split", Type.STRING, "the split of a saved DatasetDict", example='"train"'),
     Param("truncation", Type.CHOICE, "what a prompt longer than prompt_len does: error (rpeg "
           "check and run name its row; verl's default), left (keep its last prompt_len "
           "tokens), right (keep its first)", default=Truncation.ERROR.value,
           choices=tuple(t.value for t in Truncation))))

WORKLOAD_BLOCK = WORKLOAD + DATA            # what a workload block accepts


# --- length distributions (prompt_len, gen_len) ---------------------------------------------

DISTRIBUTIONS = (
    Section("fixed", "fixed(n = N)", "every length N",
            (_int("n", "the length", high=MAX_TOKENS, required=True, unit="tokens"),)),
    Section("uniform", "uniform(min = A, max = B)", "lengths uniform in [A, B]",
            (_int("min", "the shortest", high=MAX_TOKENS, required=True, unit="tokens"),
             _int("max", "the longest", high=MAX_TOKENS, required=True, unit="tokens"))),
    Section("lognormal", "lognormal(median = M, max = B, sigma = S)",
            "log-normal lengths, capped at B",
            (Param("median", Type.REAL, "the median length", unit="tokens", low=0.0,
                   low_open=True, high=MAX_TOKENS, required=True),
             _int("max", "the cap", high=MAX_TOKENS, required=True, unit="tokens"),
             Param("sigma", Type.REAL, "spread of the log-lengths", low=0.0, high=10.0,
                   derived="max at the 99.9th percentile"))),
    Section("empirical", 'empirical("FILE", max = B)',
            "a histogram file, one 'length,weight' pair per line, relative to the folder of "
            "the file that names it",
            (_int("max", "the cap", high=MAX_TOKENS, unit="tokens",
                  derived="the histogram's longest"),)),
)


def distribution(name: str) -> Section | None:
    return next((d for d in DISTRIBUTIONS if d.name == name), None)


# --- model NAME : PRESET { ... } ----------------------------------------------------------

_OPTIMIZERS = tuple(f.name for f in by_category(Category.OPTIMIZER))

MODEL = Section(
    "model", "model NAME : PRESET { KEY = VALUE ... }  (or : hf(\"FOLDER\"), or : custom)",
    "A model: a preset's architecture (rpeg help presets), or a Hugging Face folder's, with "
    "its head, its training and its weights.",
    (Param("optimizer", Type.CALL, "how it is trained (rpeg help functions adam)",
           derived=f"{_OPTIMIZERS[0]}() for a model that is not frozen", choices=_OPTIMIZERS,
           example="adam(lr = 1e-5)"),
     Param("head", Type.CHOICE, "what it outputs: lm (log-probabilities, generates), value "
           "(per-token values: a critic), reward (one score per response)",
           default=Head.LM.value, choices=tuple(h.value for h in Head)),
     Param("frozen", Type.FLAG, "never trained: a reference model, or a reward model "
           "(written alone)", default=False),
     Param("dtype", Type.CHOICE, "the type its weights are held and computed in",
           derived="bf16, or the folder's torch_dtype", choices=tuple(d.value for d in DType)),
     Param("weights", Type.STRING, "a folder of safetensors weights and config.json, "
           "relative to the folder of the file that names it; a preset must describe the "
           "folder's model",
           derived="random weights, seeded", example='"weights/actor"'),
     Param("lora", Type.CALL, "train low-rank adapters on a frozen backbone (rpeg help model "
           "lora)", choices=("lora",), example="lora(rank = 8)")))

_PRESET = "the preset's (a custom model must give it)"

ARCHITECTURE = Section(
    "architecture", "model NAME : PRESET { layers = N; ... }",
    "A preset's dimensions, overridden one by one, or all of a custom model's. A flag is "
    "written alone (qk_norm) or as qk_norm = false.",
    (_int("layers", "decoder blocks", high=MAX_DIM, derived=_PRESET),
     _int("hidden", "the model width", high=MAX_DIM, derived=_PRESET),
     _int("heads", "attention (query) heads", high=MAX_DIM, derived=_PRESET),
     _int("kv_heads", "key/value heads (grouped-query attention: fewer than heads)",
          high=MAX_DIM, derived=_PRESET),
     _int("ffn", "the MLP's inner width", high=MAX_DIM, derived=_PRESET),
     _int("vocab", "vocabulary size", high=MAX_DIM, derived=_PRESET),
     _int("head_dim", "a head's width when it is not hidden / heads (Qwen3)", high=MAX_DIM,
          derived="hidden / heads"),
     Param("qk_norm", Type.FLAG, "RMS norm on each head's query and key (Qwen3)",
           default=False),
     Param("mlp", Type.CHOICE, "gated (SwiGLU, three matrices) or plain (two, OPT's)",
           default="gated", choices=("gated", "plain")),
     _int("experts", "routed experts per mixture-of-experts layer", high=MAX_DIM,
          derived="none (dense)"),
     _int("active_experts", "routed experts each token uses (top-k)", high=MAX_DIM,
          derived="none (dense)"),
     _int("shared_experts", "experts every token uses beside the routed ones", high=MAX_DIM,
          derived="none"),
     _int("expert_ffn", "one expert's MLP width", high=MAX_DIM, derived="none (dense)"),
     _int("dense_layers", "leading layers with a dense MLP before the expert layers", low=0,
          high=MAX_DIM, default=0),
     _int("kv_lora", "latent attention (MLA): the compressed key/value width", high=MAX_DIM,
          derived="none"),
     _int("q_lora", "MLA: the compressed query width", high=MAX_DIM, derived="none"),
     _int("rope_dim", "MLA: the rotary part of each query/key head", high=MAX_DIM,
          derived="none"),
     _int("v_head", "MLA: a value head's width", high=MAX_DIM, derived="none"),
     Param("tied", Type.FLAG, "the LM head shares the token embedding's weights",
           derived="the preset's"),
     Param("family", Type.CHOICE, "the architecture family (a Hugging Face model_type)",
           derived="the preset's", choices=tuple(f.value for f in Family))))

MODEL_BLOCK = MODEL + ARCHITECTURE          # what a model block accepts

LORA = Section(
    "lora", "lora = lora(rank = R, alpha = A, targets = [...], dropout = D)",
    "Low-rank adapters: the backbone stays frozen, adapters on the target projections "
    "train (peft); the cost model prices their gradients, optimizer state and sync.",
    (_int("rank", "the adapters' rank (at most the model's hidden size)", high=4096,
          required=True),
     Param("alpha", Type.REAL, "scale numerator: the adapters are scaled by alpha / rank",
           low=0.0, low_open=True, high=1e6, derived="the rank (scale 1)"),
     Param("targets", Type.NAMES, "the projections that get adapters", choices=LORA_TARGETS,
           derived="q_proj, k_proj, v_proj, o_proj", example="[q_proj, v_proj]"),
     Param("dropout", Type.REAL, "dropout on the adapters' input", default=0.0, low=0.0,
           high=0.99)))


# --- eval { ... } and log { ... } -----------------------------------------------------------

MAX_EVAL_SAMPLES = 1024

EVAL = Section(
    "eval", "eval { dataset = \"FILE\"; every = N; ... }",
    "Held-out prompts the actor answers every N steps (and before the first): mean reward, "
    "accuracy and pass@k in eval.jsonl and the trackers.",
    (Param("dataset", Type.STRING, "the held-out prompts, a file or folder like the "
           "workload's (relative to the folder of the file that names it)", required=True, example='"data/toy.jsonl"'),
     _int("every", "evaluate every N steps", high=MAX_STEPS, required=True, unit="steps"),
     _int("samples", "responses per prompt (pass@k counts them)", high=MAX_EVAL_SAMPLES,
          default=1, unit="responses"),
     Param("temperature", Type.REAL, "sampling temperature (0: greedy)", default=1.0,
           low=0.0, high=100.0),
     _int("prompts", "how many of the dataset's rows", derived="every row", unit="prompts"),
     _int("max_len", "most tokens an answer may have", high=MAX_TOKENS,
          derived="the generate stage's", unit="tokens"),
     Param("reward", Type.NAME, "the reward that scores the answers",
           derived="the pipeline's only reward", example="long"),
     Param("split", Type.STRING, "the split of a saved DatasetDict", example='"test"')))

LOG = Section(
    "log", "log { trackers = [...]; samples = N; project = \"...\" }",
    "Where a run's metrics go besides metrics.jsonl, and how many responses it keeps.",
    (Param("trackers", Type.NAMES, "experiment trackers the metrics go to (each needs its "
           "extra installed: pip install 'rpeg[wandb]')", choices=tuple(t.value for t in Tracker),
           derived="tensorboard", example="[tensorboard]"),
     _int("samples", "responses kept per step in samples.jsonl (0: none)", low=0, high=4096,
          default=4, unit="responses"),
     Param("project", Type.STRING, "the trackers' project name", default="rpeg",
           example='"mine"')))


# --- place STAGE on gpus A..B { ... } ---------------------------------------------------------

_GEN = (OpKind.GENERATE.value,)
_MODEL_PASS = (OpKind.FORWARD.value, OpKind.SCORE.value, OpKind.TRAIN.value)
_ALL = _GEN + _MODEL_PASS


def _degree(name: str, doc: str, applies: tuple[str, ...]) -> Param:
    return _int(name, doc, high=MAX_GPU, applies=applies, derived="searched")


def _switch(name: str, doc: str, applies: tuple[str, ...]) -> Param:
    return Param(name, Type.FLAG, doc, applies=applies, derived="searched")


PLACE = Section(
    "place", "place STAGE on gpus A..B { KEY = VALUE ... }",
    "A stage pinned to devices, with any part of its layout; what the block leaves out the "
    "planner searches. Which keys a stage may pin depends on its kind (a score stage: one "
    "with a reward model; a stage on the host pins devices only). A flag is written alone "
    "(recompute) or as recompute = false.",
    (_degree("dp", "data-parallel degree", _ALL),
     _degree("tp", "tensor-parallel degree (divides the heads and the KV heads)", _ALL),
     _degree("pp", "pipeline-parallel degree (at most the layers)", _ALL),
     _degree("cp", "context-parallel degree (a sequence split over devices)", _MODEL_PASS),
     _degree("ep", "expert-parallel degree (divides the experts)", _MODEL_PASS),
     _degree("microbatches", "micro-batches per pass (at least pp)", _MODEL_PASS),
     Param("zero", Type.INT, "ZeRO level: 0 replicated, 1 optimizer state sharded, 2 and "
           "gradients, 3 and weights (a forward or generate stage: ZeRO-3 inference)",
           low=0, high=3, applies=_ALL, derived="searched"),
     _switch("packing", "sequences packed without padding", _MODEL_PASS),
     _switch("param_offload", "weights in host memory between passes", _ALL),
     Param("engine", Type.CHOICE, "who executes it (generate: "
           + " | ".join(e.value for e in GENERATE_ENGINES) + "; the others: "
           + " | ".join(e.value for e in PASS_ENGINES) + ")", applies=_ALL, derived="searched",
           choices=tuple(dict.fromkeys(e.value for e in GENERATE_ENGINES + PASS_ENGINES))),
     _switch("recompute", "activations recomputed in the backward pass", (OpKind.TRAIN.value,)),
     _switch("offload", "the optimizer state in host memory between train ops",
             (OpKind.TRAIN.value,)),
     _degree("chunks", "responses streamed to the next stages in this many chunks, rounded up "
             "to as many on each data-parallel block", _GEN),
     _degree("max_num_seqs", "sequences an engine replica decodes at once (vLLM's "
             "max_num_seqs)", _GEN),
     Param("kv_fraction", Type.REAL, "share of a device's memory the engine takes (vLLM's "
           "gpu_memory_utilization)", low=0.0, low_open=True, high=1.0, applies=_GEN,
           derived="searched"),
     _switch("cuda_graph", "decode with CUDA graphs (vLLM)", _GEN)))


def layout_keys(kind: OpKind) -> tuple[str, ...]:
    """What ``place`` may pin of a stage of ``kind``."""
    return tuple(p.name for p in PLACE.params if kind.value in p.applies)


# --- cluster NAME { ... }, link LEVEL { ... } ----------------------------------------------------

CLUSTER = Section(
    "cluster", "cluster NAME { gpu = ...; gpus_per_node = N; ...; link LEVEL { ... } }",
    "The machines a plan is made for: nodes of gpus_per_node devices, nodes_per_rack nodes "
    "to a rack, racks racks (nodes_per_rack x racks nodes in all), and the link at each "
    "level.",
    (Param("gpu", Type.BLOCK, "the device: a builtin profile's name, a profile file, or "
           "inline: gpu NAME { KEY = VALUE ... } (rpeg help profile)", required=True,
           example="local_cpu"),
     _int("gpus_per_node", "devices per node", high=MAX_GPU, required=True),
     _int("nodes_per_rack", "nodes per rack", high=MAX_GPU, default=1),
     _int("racks", "racks", high=MAX_GPU, default=1),
     Param("reserve", Type.QUANTITY, "share of each device's memory plans leave free "
           "(fragmentation, spikes), over the profile's", unit="fraction", low=0.0,
           derived="the profile's (10% unless it says)", example="10%"),
     _int("tool_cores", "host cores per node that run tool calls (a generate stage's tools: "
          "each call takes its tool's cores; the cost model queues calls on them)",
          high=MAX_GPU, derived="one per device"),
     Param("link", Type.BLOCK, "link gpu | node | rack { bandwidth; latency }: between the "
           "devices of a node, the nodes of a rack, the racks; each level the cluster has "
           "needs one", derived="needed for each level with more than one unit",
           example="gpu { bandwidth = 1 GB/s; latency = 200 us }")))

LINK = Section(
    "link", "link gpu | node | rack { bandwidth = ...; latency = ... }",
    "One level of the cluster's network.",
    (Param("bandwidth", Type.QUANTITY, "per device, one direction", unit="bytes/s",
           required=True, example="25 GB/s"),
     Param("latency", Type.QUANTITY, "of one message", unit="s", required=True,
           example="5 us")))


# --- profile NAME { ... } --------------------------------------------------------------------

# What each field of GpuProfile means (its unit is in the field's metadata); a field without a
# line here fails the reference's test, so a new figure of the cost model is documented.
PROFILE_DOCS: dict[str, str] = {
    "memory": "device memory capacity",
    "peak_flops": "datasheet dense bf16 throughput (reference only)",
    "matmul_flops": "measured large-GEMM throughput",
    "fp8_flops": "large FP8 GEMM throughput (0: no FP8)",
    "matmul_half": "GEMM FLOPs at which half of matmul_flops is reached",
    "matmul_m_half": "GEMM rows at which skinny GEMMs run at half rate",
    "attn_flops": "fused-attention throughput (0: 0.6 x matmul_flops)",
    "hbm_bandwidth": "datasheet memory bandwidth",
    "mem_bandwidth": "measured streaming bandwidth",
    "elem_bandwidth": "effective rate of elementwise ops (0: mem_bandwidth)",
    "launch_overhead": "fixed cost per kernel or op call",
    "layer_overhead": "host time per transformer layer per forward call",
    "call_overhead": "host time per model call (embedding, head, wrapper)",
    "decode_overhead": "host time per decode step (sampling, cache bookkeeping)",
    "backward_factor": "backward time / forward time",
    "optimizer_tensor_overhead": "per parameter tensor per optimizer step",
    "sample_overhead": "per sample of a host-side op (python reward, gae)",
    "async_launch": "1: host overhead overlaps device work (a GPU); 0: it adds (a CPU)",
    "compute_bytes": "bytes per value the device computes in (0: the model's dtype)",
    "act_factor": "multiplier on the activation-memory formula",
    "runtime_memory": "fixed transient memory per op (CUDA context, communication "
                      "buffers, workspaces)",
    "reserve": "share of memory plans leave free (fragmentation, spikes; vLLM's "
               "gpu_memory_utilization 0.9 leaves 10%)",
    "source": "where the figures come from",
    "dispatch_s": "scheduler time one task crossing adds (Dask)",
    "host_cores": "cores the control plane shares with the devices' ops (a CPU's; 0: it "
                  "has a host of its own, priced by the control terms below)",
    "control_step_s": "control-plane CPU per device per step",
    "control_task_s": "control-plane CPU per task per step",
    "control_idle": "CPU seconds per second an idle local cluster burns per process (the "
                    "client's and each device worker's: heartbeats, monitors)",
    "control_call_s": "on a host of its own: the client's scheduling core per op call (this "
                      "and the seven terms below: 0, the shipped local_cpu profile's)",
    "client_task_s": "on a host of its own: Dask's client CPU per task",
    "client_arg_s": "on a host of its own: the client's CPU per future a task takes",
    "client_worker_s": "on a host of its own: the client's CPU per worker per step",
    "scheduler_task_s": "on a host of its own: the Dask scheduler's CPU per task",
    "scheduler_arg_s": "on a host of its own: the scheduler's CPU per future a task takes",
    "scheduler_worker_s": "on a host of its own: the scheduler's CPU per worker per step",
    "scheduler_heartbeat_s": "on a host of its own: the scheduler's CPU per worker heartbeat",
    "concurrency_slowdown": "one device's op CPU time while every device of its host computes / alone (1 to the host's devices)",
    "reward_call_overhead": "per call of a python reward",
    "reward_sample_overhead": "per sample of a python reward (unset: sample_overhead)",
    "reward_token_time": "per response token of a python reward",
    "compute_call_overhead": "per call of a host compute op (gae, ...)",
    "compute_sample_time": "per sample of a host compute op (unset: sample_overhead)",
    "compute_token_time": "per token of a host compute op",
    "sample_logit_time": "host time per logit a decode step samples from (a row x the vocabulary: temperature, top-p, the draw; 0: priced in the step)",
    "host_bandwidth": "device <-> host memory, one way (offload)",
    "host_memory_bandwidth": "one rank's host memory streaming (CPU Adam step)",
    "disk_bandwidth": "one node's write of checkpoint files, fsync'd (rpeg.cost.checkpoint). "
                      "Measured by the local calibration (64 MB written and fsync'd in the "
                      "cache folder, median of 3). Default 1 GB/s, conservative: a GPU "
                      "node's local data-center NVMe writes ~2-6 GB/s sequentially (e.g. "
                      "~4 GB/s for a PCIe Gen4 U.2 drive), but the node's ranks share it "
                      "and a run folder on a shared or network filesystem writes less",
    "hash_bandwidth": "one checkpoint writer's SHA-256 of the files it wrote (read back "
                      "from its page cache; a node's writers at once, each at this rate). "
                      "Measured by the local calibration (hashlib.sha256 over 64 MB in "
                      "memory, median of 3). Default 1 GB/s, conservative: hashlib's "
                      "OpenSSL SHA-256 with SHA-NI (x86) or the Armv8 SHA2 instructions "
                      "runs ~1.5-2 GB/s on one server core (openssl speed sha256, large "
                      "blocks), less beside the node's other host work",
    "grads_freed": "1: the backend frees gradients after each step",
    "packed_seq_overhead": "host time per sequence per layer of a packed forward pass, where "
                           "each sequence is its own attention call (no variable-length "
                           "kernel: a CPU)",
    "dp_tensor_overhead": "host time per parameter tensor per optimizer step of a "
                          "data-parallel rank: gradient hooks, bucket copies and its "
                          "collectives' copies where the devices are the host's cores (rpeg "
                          "calibrate, on two worker ranks)",
    "shard_tensor_overhead": "host time per parameter tensor per optimizer step an FSDP2 "
                             "(ZeRO 2-3) data-parallel rank adds to dp_tensor_overhead: its "
                             "sharded tensors' optimizer and clipping ops, its hooks (rpeg "
                             "calibrate, on two worker ranks)",
    "shard_layer_overhead": "host time per transformer layer per micro-batch an FSDP2 "
                            "(ZeRO 2-3) data-parallel rank adds: each layer's all-gather, "
                            "reshard and reduce-scatter calls beyond the bytes they move, "
                            "where the devices are the host's cores (rpeg calibrate, on two "
                            "worker ranks, in one micro-batch and in two)",
    "tp_layer_overhead": "host time per transformer layer per pass (forward, backward, "
                         "decode step) a tensor-parallel (tp > 1) op of the torch backend "
                         "adds: DTensor's work on its split projections and the ranks' waits "
                         "at its all-reduces, where the devices are the host's cores (rpeg "
                         "calibrate, on two worker ranks; vLLM splits its layers its own way "
                         "and does not pay it)",
    "tool_call_s": "a sandboxed tool call that answers at once (rpeg calibrate --tools): "
                   "a tool that declares no latency is priced with it",
    "vllm_layer_overhead": "vLLM's host time per layer per forward call (unset: "
                           "layer_overhead)",
    "vllm_decode_overhead": "vLLM's host time per decode step (unset: decode_overhead)",
    "vllm_work_scale": "vLLM's device work / the model's",
    "threads": "torch threads per device (measured, reference only)",
    "copy_bandwidth": "memory copy rate (measured, reference only)",
    "gloo_bandwidth": "all-reduce bandwidth between two workers (measured, reference only)",
    "gloo_latency": "all-reduce latency between two workers (measured, reference only)",
    "bf16_matmul_flops": "large bf16 GEMM throughput (measured, reference only)",
}


# The figures a profile must give, each more than 0 (the cost model divides by them):
# (key, what it is, an example value).
PROFILE_REQUIRED = (("memory", "the device memory", "80 GB"),
                    ("matmul_flops", "the measured large-GEMM throughput", "700 TFLOPS"),
                    ("mem_bandwidth", "the measured streaming bandwidth", "3000 GB/s"))


# Profile figures with a range narrower than >= 0: (type, low, high) -- a slowdown is at
# least 1 (an op computes no faster beside others), async_launch a switch.
PROFILE_RANGES = {"concurrency_slowdown": (Type.REAL, 1.0, None),
                  "async_launch": (Type.INT, 0, 1)}


def profile_section() -> Section:
    """A profile's keys: the fields of ``GpuProfile`` the language sets, each in its unit."""
    params = []
    for a in attrs.fields(GpuProfile):
        if a.name == "source":
            params.append(Param("source", Type.STRING, PROFILE_DOCS.get("source", ""),
                                example='"measured here"'))
        elif "unit" in a.metadata:
            unit = a.metadata["unit"]
            unset = "unset" if a.default is None else ""
            kind, low, high = PROFILE_RANGES.get(
                a.name, (Type.QUANTITY if unit else Type.REAL, 0.0, None))
            params.append(Param(a.name, kind, PROFILE_DOCS.get(a.name, ""), unit=unit,
                                low=low, high=high, default=a.default, derived=unset,
                                required=any(a.name == k for k, _, _ in PROFILE_REQUIRED),
                                example=V.EXAMPLES.get(unit, "1")))
    return Section(
        "profile", "profile NAME { KEY = VALUE ... }  (a file; or gpu NAME { ... } in a cluster)",
        "What the cost model knows of one device, each figure with its unit: measured by "
        "rpeg calibrate where it can be, cited where not; a figure left out is the default.",
        tuple(params))



# --- reading a block's values --------------------------------------------------------------

def assigned(e: ast.Entry, key: str) -> ast.Value:
    """The value of ``key = VALUE``: a flag or a block is an error."""
    if not isinstance(e, ast.Assign):
        raise SpecError(f"{key} must be set with '{key} = VALUE'", e.span)
    return e.value


def read(e: ast.Entry, p: Param) -> object:
    """A block entry's value as ``p``'s type, checked against its documented range."""
    if p.type is Type.FLAG:
        if isinstance(e, ast.Flag):
            return True
        return V.name(assigned(e, p.name), p.name, ("true", "false")) == "true"
    return convert(assigned(e, p.name), p)


def convert(v: ast.Value, p: Param) -> object:
    """A written value (a block's, or a keyword's of lora(...)) as ``p``'s plain type."""
    if p.type is Type.INT:
        return V.integer(v, p.name, minimum=int(p.low if p.low is not None else 0),
                         maximum=int(p.high if p.high is not None else V.MAX_INT))
    if p.type is Type.REAL:
        if p.low_open and p.low == 0:
            return V.real(v, p.name, positive=True, maximum=p.high)
        return V.real(v, p.name, minimum=p.low, maximum=p.high)
    if p.type is Type.CHOICE:
        return V.name(v, p.name, p.choices)
    if p.type is Type.NAME:
        return V.name(v, p.name)
    if p.type is Type.STRING:
        return V.string(v, p.name)
    if p.type is Type.QUANTITY:
        return V.quantity(v, p.unit, p.name)
    raise TypeError(f"{p.name}: a {p.type.value} is read by its own checker")


def entries(block: ast.Block, section: Section | tuple[str, ...], where: str
            ) -> dict[str, ast.Entry]:
    """A block's entries by key, each key one of the section's and written once."""
    allowed = section.keys if isinstance(section, Section) else section
    out: dict[str, ast.Entry] = {}
    for e in block.entries:
        key = e.kind if isinstance(e, ast.Section) else e.key
        if key.value not in allowed:
            raise V.unknown_key(key, allowed, where)
        if key.value in out:
            raise V.duplicate("key", key.value, key.span, out[key.value].span)
        out[key.value] = e
    return out


SECTIONS: tuple[Section, ...] = (WORKLOAD, DATA, *DISTRIBUTIONS, MODEL, ARCHITECTURE, LORA,
                                 EVAL, LOG, PLACE, CLUSTER, LINK)


__all__ = ["Section", "SECTIONS", "PROFILE_DOCS", "profile_section", "WORKLOAD", "DATA", "WORKLOAD_BLOCK", "DISTRIBUTIONS",
           "MODEL", "ARCHITECTURE", "MODEL_BLOCK", "LORA", "EVAL", "LOG", "PLACE", "CLUSTER",
           "LINK", "assigned", "convert", "entries", "read", "layout_keys", "distribution"]
