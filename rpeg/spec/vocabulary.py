"""The field's vocabulary: names users bring from verl, OpenRLHF, NeMo-RL and TRL, and rpeg's
key for the same thing.

    >>> print(foreign_hint("ppo_epochs", ("loss", "minibatches", "epochs")))
    'ppo_epochs' is among verl's, OpenRLHF's and TRL's names for passes over a step's batch; here rpeg calls it 'epochs'
    >>> print(foreign_hint("kl_coef", ("loss", "minibatches", "epochs")))
    'kl_coef' is among verl's and OpenRLHF's names for the KL coefficient; in rpeg: kl, a keyword of the advantage estimator (gae(..., kl = 0.01): a penalty in the reward) or of the policy loss (loss = grpo(0.2, kl = 0.001): a loss term)

A key the checker does not know is looked up here before any spelling suggestion, so
``kl_coef`` in an estimator reads "here rpeg calls it 'kl'" rather than "did you mean
'coef'". A dotted name (a Hydra override such as ``actor_rollout_ref.rollout.n=8``) is
looked up whole, then by its last parts. Each entry names rpeg's keys as ``SECTION.KEY``
or ``FUNCTION.KEYWORD`` (the sections of ``rpeg.spec.keys``, the functions of
``rpeg.spec.functions``), a function or section alone, or a statement; a test checks that
each exists and that the hint names it. ``rpeg help vocabulary`` prints the table.
"""

from __future__ import annotations

import attrs

# Statements of the language a foreign setting may map to (grammar/rpeg.lark).
STATEMENTS = ("staleness", "share", "colocate", "place")


@attrs.frozen
class Foreign:
    """Names other systems use for one setting, and how rpeg says it."""

    names: tuple[str, ...]            # as those systems write them (a dotted config path's tail)
    systems: str                      # whose names they are
    what: str                         # the setting, in a few words
    rpeg: tuple[str, ...]             # rpeg's keys: SECTION.KEY, FUNCTION.KEYWORD, or a name
    how: str                          # how rpeg writes it, naming every key of ``rpeg``
    same: bool = True                 # rpeg's key means the same (a rename), not a neighbour

    def keys(self) -> tuple[str, ...]:
        """The bare key names (``kl`` of ``gae.kl``)."""
        return tuple(dict.fromkeys(r.rsplit(".", 1)[-1] for r in self.rpeg))


def _f(names: str, systems: str, what: str, rpeg: str, how: str, same: bool = True) -> Foreign:
    return Foreign(tuple(names.split()), systems, what, tuple(rpeg.split()), how, same)


_KL_HOW = ("kl, a keyword of the advantage estimator (gae(..., kl = 0.01): a penalty in the "
           "reward) or of the policy loss (loss = grpo(0.2, kl = 0.001): a loss term)")
_MICRO_HOW = ("microbatches, the plan's choice; to pin it: place STAGE on gpus A..B "
              "{ microbatches = N } (micro-batches per pass, not their size)")
_OPT = "optimizer = adam(lr = ...)"

FOREIGN: tuple[Foreign, ...] = (
    # --- the KL to the reference ---------------------------------------------------------------
    _f("kl_coef init_kl_coef", "verl's and OpenRLHF's", "the KL coefficient",
       "gae.kl grpo.kl", _KL_HOW),
    _f("kl_loss_coef reference_policy_kl_penalty beta", "verl's, NeMo-RL's and TRL's",
       "the KL loss term's coefficient", "grpo.kl", "kl of the policy loss: loss = grpo(0.2, "
       "kl = 0.001)"),
    _f("use_kl_loss", "verl's and OpenRLHF's", "a KL term in the loss", "grpo.kl",
       "the loss has a KL term when its kl is above 0: loss = grpo(0.2, kl = 0.001)", same=False),
    _f("use_kl_in_reward", "verl's", "a KL penalty in the reward", "gae.kl",
       "the estimator's kl: gae(..., kl = 0.01)"),
    _f("kl_penalty kl_loss_type", "verl's", "how the KL is estimated",
       "gae.kl_estimator grpo.kl_estimator",
       "kl_estimator = k1 | k2 | k3 beside kl (verl's low_var_kl is k3)"),
    _f("target_kl kl_ctrl.type", "verl's", "the adaptive KL controller's target",
       "ppo_clip.kl_target", "kl_target, a keyword of the policy loss beside kl: loss = "
       "ppo_clip(0.2, kl = 0.01, kl_target = 0.02)"),
    _f("kl_ctrl.horizon", "verl's", "the adaptive KL controller's horizon",
       "ppo_clip.kl_horizon", "kl_horizon, a keyword of the policy loss beside kl_target"),
    # --- clipping and the policy loss -----------------------------------------------------------
    _f("clip_ratio eps_clip epsilon cliprange", "verl's, OpenRLHF's and TRL's",
       "the PPO clipping range", "ppo_clip.clip",
       "clip, the policy loss's first value: loss = ppo_clip(0.2)"),
    _f("clip_ratio_low ratio_clip_min", "verl's and NeMo-RL's", "the lower clipping range",
       "ppo_clip.clip_low", "clip_low, a keyword of the policy loss: loss = ppo_clip(0.2, "
       "clip_low = 0.2)"),
    _f("clip_ratio_high ratio_clip_max epsilon_high", "verl's, NeMo-RL's and TRL's",
       "the upper clipping range (DAPO's clip-higher)", "ppo_clip.clip_high",
       "clip_high, a keyword of the policy loss: loss = ppo_clip(0.2, clip_high = 0.28)"),
    _f("eps_clip_low_high", "OpenRLHF's", "the lower and upper clipping ranges",
       "ppo_clip.clip_low ppo_clip.clip_high",
       "clip_low and clip_high, keywords of the policy loss", same=False),
    _f("clip_ratio_c ratio_clip_c", "verl's and NeMo-RL's", "dual-clip PPO's bound",
       "ppo_clip.dual_clip", "dual_clip, a keyword of the policy loss: loss = ppo_clip(0.2, "
       "dual_clip = 3)"),
    _f("cliprange_value value_clip", "verl's, TRL's and OpenRLHF's", "the value clipping range",
       "value_mse.clip", "clip of the value loss: loss = value_mse(clip = 0.5)"),
    _f("vf_coef value_loss_coef", "TRL's", "the value loss's weight", "value_mse.coef",
       "coef of the value loss, on a shared backbone: loss = value_mse(coef = 0.5)"),
    _f("entropy_coeff entropy_loss_coef entropy_coef", "verl's and OpenRLHF's",
       "the entropy bonus", "ppo_clip.entropy",
       "entropy, a keyword of the policy loss: loss = ppo_clip(0.2, entropy = 0.001)"),
    _f("loss_agg_mode loss_type token_level_loss", "verl's, TRL's and NeMo-RL's",
       "how token losses are aggregated", "ppo_clip.agg",
       "agg, a keyword of the policy loss: token_mean (DAPO), seq_mean_token_mean, "
       "seq_mean_token_sum (Dr. GRPO: TRL's dr_grpo; verl's seq-mean-token-sum, without "
       "the budget, is budget times larger)", same=False),
    _f("policy_loss_type loss_mode importance_sampling_level", "OpenRLHF's, verl's and TRL's",
       "which policy loss", "train.loss", "the train stage's loss: loss = ppo_clip(...) | "
       "grpo(...) | gspo(...) (gspo: sequence-level ratios)", same=False),
    _f("tis_imp_ratio_cap vllm_is_truncated_threshold enable_vllm_is_correction "
       "use_importance_sampling_correction", "verl's, OpenRLHF's and NeMo-RL's",
       "truncated importance sampling against the generator", "ppo_clip.tis",
       "tis, a keyword of the policy loss: loss = ppo_clip(0.2, tis = 2)"),
    # --- advantages -----------------------------------------------------------------------------
    _f("adv_estimator advantage_estimator", "verl's and OpenRLHF's", "the advantage estimator",
       "gae group_norm rloo reinforce remax", "a stage of its own: stage adv = gae(...) | "
       "group_norm(...) | rloo(...) | reinforce(...) | remax(...)"),
    _f("use_leave_one_out_baseline", "NeMo-RL's", "a leave-one-out baseline", "rloo",
       "the rloo estimator: stage adv = rloo(scores) -> advantages"),
    _f("norm_adv_by_std_in_grpo", "verl's", "dividing by the group's standard deviation",
       "group_norm.std", "std of group_norm: group_norm(scores, std = false) is Dr. GRPO"),
    _f("scale_rewards no_advantage_std_norm", "TRL's and OpenRLHF's",
       "dividing by the group's standard deviation", "group_norm.std",
       "std of group_norm: group_norm(scores, std = false) is Dr. GRPO", same=False),
    _f("lambd", "OpenRLHF's", "GAE's lambda", "gae.lam", "lam of gae: gae(..., lam = 0.95)"),
    # --- batches, epochs, steps ---------------------------------------------------------------
    _f("ppo_epochs max_epochs num_iterations", "verl's, OpenRLHF's and TRL's",
       "passes over a step's batch", "train.epochs",
       "epochs of the train stage: train(MODEL, ..., epochs = 2)"),
    _f("ppo_mini_batch_size train_global_batch_size mini_batch_size",
       "verl's and NeMo-RL's", "responses per optimizer step", "train.minibatches",
       "minibatches of the train stage, how many optimizer steps a step's batch is split "
       "into: train(MODEL, ..., minibatches = responses per step / mini-batch size)", same=False),
    _f("train_batch_size", "verl's (prompts per step) and OpenRLHF's (responses per optimizer "
       "step)", "a batch size", "workload.prompts train.minibatches",
       "prompts per step are the workload's prompts; optimizer steps per step are the train "
       "stage's minibatches", same=False),
    _f("micro_batch_size ppo_micro_batch_size ppo_micro_batch_size_per_gpu "
       "micro_train_batch_size train_micro_batch_size per_device_train_batch_size "
       "gradient_accumulation_steps log_prob_micro_batch_size micro_rollout_batch_size "
       "logprob_batch_size", "verl's, OpenRLHF's, NeMo-RL's and TRL's",
       "the micro-batch", "place.microbatches", _MICRO_HOW, same=False),
    _f("rollout_batch_size num_prompts_per_step", "OpenRLHF's and NeMo-RL's",
       "prompts per step", "workload.prompts", "prompts in the workload block"),
    _f("rollout.n n n_samples_per_prompt num_generations num_generations_per_prompt",
       "verl's, OpenRLHF's, TRL's and NeMo-RL's", "responses per prompt", "workload.samples",
       "samples in the workload block: samples = 8"),
    _f("total_training_steps max_steps max_num_steps total_epochs num_episodes",
       "verl's, TRL's, NeMo-RL's and OpenRLHF's", "how long a run is", "workload.steps",
       "steps in the workload block: rpeg counts RL steps, not passes over the dataset", same=False),
    # --- lengths and data ---------------------------------------------------------------------
    _f("max_prompt_length prompt_max_len prompt_length max_input_seq_length",
       "verl's, TRL's, OpenRLHF's and NeMo-RL's", "the longest prompt", "workload.prompt_len",
       "prompt_len in the workload block"),
    _f("max_response_length response_length generate_max_len max_completion_length "
       "max_new_tokens max_tokens", "verl's, OpenRLHF's, TRL's, NeMo-RL's and vLLM's",
       "the longest response", "workload.gen_len generate.max_len",
       "gen_len in the workload block (the lengths' distribution, its max the longest), and "
       "max_len of a generate stage to cap it", same=False),
    _f("max_total_sequence_length max_model_len max_seq_len", "NeMo-RL's and vLLM's",
       "prompt plus response", "workload.prompt_len workload.gen_len",
       "prompt_len + the max of gen_len, both in the workload block", same=False),
    _f("train_files prompt_data dataset_name train_data_path", "verl's, OpenRLHF's and "
       "NeMo-RL's", "the training prompts", "data.dataset",
       'dataset in the workload block: dataset = "data/train.jsonl"'),
    _f("val_files eval_dataset val_data_path", "verl's, OpenRLHF's and NeMo-RL's",
       "the held-out prompts", "eval.dataset", 'dataset of the eval block: eval { dataset = '
       '"data/test.jsonl"; every = 10 }'),
    _f("prompt_key input_key", "verl's, OpenRLHF's and NeMo-RL's", "the prompt's column",
       "data.prompt_field", 'prompt_field in the workload block: prompt_field = "question"'),
    _f("label_key output_key", "OpenRLHF's and NeMo-RL's", "the answer's column",
       "data.answer_field", 'answer_field in the workload block: answer_field = "solution"'),
    _f("apply_chat_template", "OpenRLHF's", "the chat template", "data.template",
       "template in the workload block: template = chat"),
    _f("prompt_split", "OpenRLHF's", "the dataset's split", "data.split",
       'split in the workload block: split = "train"'),
    _f("eval_split", "OpenRLHF's", "the held-out dataset's split", "eval.split",
       'split of the eval block'),
    # --- evaluation and logging -----------------------------------------------------------------
    _f("test_freq eval_steps val_period", "verl's, OpenRLHF's, TRL's and NeMo-RL's",
       "how often to evaluate", "eval.every", "every of the eval block: eval { dataset = "
       '"..."; every = 10 }'),
    _f("eval_n_samples_per_prompt", "OpenRLHF's", "responses per held-out prompt",
       "eval.samples", "samples of the eval block"),
    _f("eval_temperature", "OpenRLHF's", "the evaluation's temperature", "eval.temperature",
       "temperature of the eval block"),
    _f("max_val_samples", "NeMo-RL's", "held-out prompts per evaluation", "eval.prompts",
       "prompts of the eval block"),
    _f("logger report_to use_wandb use_tensorboard", "verl's, TRL's and OpenRLHF's",
       "where metrics go", "log.trackers", "trackers of the log block: log { trackers = "
       "[tensorboard, wandb] }"),
    _f("project_name wandb_project", "verl's and OpenRLHF's", "the trackers' project",
       "log.project", 'project of the log block: log { project = "mine" }'),
    # --- generation -----------------------------------------------------------------------------
    _f("gpu_memory_utilization vllm_gpu_memory_utilization", "verl's, NeMo-RL's, OpenRLHF's "
       "and TRL's", "the engine's share of device memory", "generate.kv_fraction "
       "place.kv_fraction", "kv_fraction of a generate stage, or of its place block"),
    _f("rollout.name use_vllm vllm_num_engines", "verl's, TRL's and OpenRLHF's",
       "the generation engine", "generate.engine place.dp",
       "engine of a generate stage (engine = vllm); its replicas are the plan's dp", same=False),
    _f("enforce_eager", "verl's and OpenRLHF's", "CUDA graphs off", "place.cuda_graph",
       "cuda_graph = false in a generate stage's place block", same=False),
    _f("do_sample", "verl's", "sampling against greedy decoding", "generate.temperature",
       "temperature of a generate stage (0: greedy)", same=False),
    _f("filter_groups dynamic_filtering max_num_gen_batches", "verl's and OpenRLHF's",
       "dynamic sampling (DAPO)", "generate.refill_rounds",
       "refill_rounds of a generate stage: generate(actor, prompts, refill_rounds = 2)", same=False),
    _f("overlong_buffer overlong_buffer_len overlong_penalty_factor", "verl's and OpenRLHF's",
       "DAPO's overlong penalty", "overlong.buffer", "a reward of its own: reward long = "
       "overlong(buffer = 512), added with a second score stage", same=False),
    # --- parallelism and memory -----------------------------------------------------------------
    _f("tensor_model_parallel_size vllm_tensor_parallel_size tensor_parallel_size tp_size "
       "ds_tensor_parallel_size", "verl's, NeMo-RL's, OpenRLHF's and TRL's",
       "the tensor-parallel degree", "place.tp",
       "the plan's choice; to pin it: place STAGE on gpus A..B { tp = 2 }"),
    _f("pipeline_model_parallel_size pipeline_parallel_size", "NeMo-RL's and Megatron's",
       "the pipeline-parallel degree", "place.pp", "place STAGE on gpus A..B { pp = 2 }"),
    _f("context_parallel_size ulysses_sequence_parallel_size ring_attn_size",
       "NeMo-RL's, verl's and OpenRLHF's", "the context-parallel degree", "place.cp",
       "place STAGE on gpus A..B { cp = 2 }"),
    _f("expert_model_parallel_size expert_parallel_size", "NeMo-RL's and Megatron's",
       "the expert-parallel degree", "place.ep", "place STAGE on gpus A..B { ep = 8 }"),
    _f("zero_stage", "OpenRLHF's", "the ZeRO stage", "place.zero",
       "place STAGE on gpus A..B { zero = 3 }"),
    _f("enable_gradient_checkpointing gradient_checkpointing activation_checkpointing",
       "verl's, OpenRLHF's, TRL's and NeMo-RL's", "activation recomputation",
       "place.recompute", "the plan's choice; to pin it: place STEP on gpus A..B "
       "{ recompute }"),
    _f("optimizer_offload adam_offload", "verl's and OpenRLHF's",
       "the optimizer state in host memory", "place.offload",
       "place STEP on gpus A..B { offload }"),
    _f("cpu_offload", "NeMo-RL's", "weights and optimizer state in host memory",
       "place.param_offload place.offload",
       "place STAGE on gpus A..B { param_offload; offload }", same=False),
    _f("use_remove_padding packing_samples sequence_packing", "verl's, OpenRLHF's and "
       "NeMo-RL's", "sequences packed without padding", "place.packing",
       "place STAGE on gpus A..B { packing }"),
    _f("hybrid_engine colocate_all_models colocated", "verl's, OpenRLHF's and NeMo-RL's",
       "generation on the training devices", "colocate",
       "a statement: colocate rollout, actor_step (or leave it to the planner)"),
    _f("async_train async_grpo max_trajectory_age_steps staleness_threshold",
       "OpenRLHF's, NeMo-RL's and verl's", "asynchronous training", "staleness",
       "a statement: staleness rollout <= 1 (how many updates old the weights a stage reads "
       "may be)"),
    # --- the optimizer --------------------------------------------------------------------------
    _f("lr learning_rate actor_learning_rate critic_learning_rate", "verl's, TRL's and "
       "OpenRLHF's", "the learning rate", "adam.lr", f"lr of the model's optimizer: {_OPT}"),
    _f("weight_decay l2", "verl's and OpenRLHF's", "weight decay", "adam.weight_decay",
       "weight_decay of the model's optimizer: optimizer = adamw(lr = 1e-6, weight_decay = "
       "0.01)"),
    _f("lr_warmup_steps warmup_steps lr_warmup_iters", "verl's, TRL's and NeMo-RL's",
       "learning-rate warmup", "adam.warmup", "warmup of the model's optimizer, in steps: "
       "optimizer = adam(lr = 1e-6, warmup = 10)"),
    _f("lr_warmup_steps_ratio lr_warmup_ratio warmup_ratio", "verl's, OpenRLHF's and TRL's",
       "learning-rate warmup", "adam.warmup", "warmup of the model's optimizer, in steps "
       "(the ratio times the workload's steps): optimizer = adam(lr = 1e-6, warmup = 10)",
       same=False),
    _f("warmup_style lr_scheduler lr_scheduler_type lr_decay_style", "verl's, OpenRLHF's, "
       "TRL's and NeMo-RL's", "the learning-rate schedule", "adam.schedule",
       "schedule of the model's optimizer: constant | linear | cosine"),
    _f("min_lr_ratio", "verl's", "where a decaying schedule ends", "adam.min_lr",
       "min_lr of the model's optimizer (a learning rate, not a ratio)", same=False),
    _f("max_norm max_grad_norm clip_grad grad_clip", "OpenRLHF's, TRL's, NeMo-RL's and "
       "verl's", "gradient clipping", "adam.grad_clip",
       "grad_clip of the model's optimizer: optimizer = adam(lr = 1e-6, grad_clip = 1.0)"),
    _f("adam_betas betas adam_beta1 adam_beta2", "OpenRLHF's, NeMo-RL's and TRL's",
       "Adam's betas", "adam.beta1 adam.beta2", "beta1 and beta2 of the model's optimizer", same=False),
    _f("adam_epsilon adam_eps", "TRL's and NeMo-RL's", "Adam's epsilon", "adam.eps",
       "eps of the model's optimizer"),
    # --- models ---------------------------------------------------------------------------------
    _f("bf16 precision", "OpenRLHF's, TRL's and NeMo-RL's", "the weights' dtype",
       "model.dtype", "dtype of the model block: dtype = bf16", same=False),
    _f("lora_rank lora_r", "verl's, OpenRLHF's and peft's", "the LoRA rank", "lora.rank",
       "rank of the model's lora: lora = lora(rank = 8)"),
    _f("lora_alpha", "verl's and OpenRLHF's", "the LoRA scale", "lora.alpha",
       "alpha of the model's lora: lora = lora(rank = 8, alpha = 16)"),
    _f("target_modules lora_target_modules", "verl's, OpenRLHF's and peft's",
       "the adapted projections", "lora.targets",
       "targets of the model's lora: lora = lora(rank = 8, targets = [q_proj, v_proj])"),
    _f("lora_dropout", "OpenRLHF's and peft's", "the adapters' dropout", "lora.dropout",
       "dropout of the model's lora"),
    _f("pretrain model_name model_name_or_path model.path", "OpenRLHF's, NeMo-RL's, TRL's and "
       "verl's", "the model's weights", "model.weights",
       'a model read from its folder: model actor : hf("FOLDER"), or weights = "FOLDER" '
       "beside a preset"),
    _f("critic_pretrain reward_pretrain", "OpenRLHF's", "a critic's or reward model's weights",
       "model.head model.weights", 'a model of its own: model critic : hf("FOLDER") '
       "{ head = value } (head = reward for a reward model, with weights)", same=False),
    # --- the cluster ----------------------------------------------------------------------------
    _f("nodes nnodes num_nodes actor_num_nodes", "verl's and NeMo-RL's", "the nodes in all",
       "cluster.nodes_per_rack cluster.racks",
       "rpeg counts them as nodes_per_rack x racks (nodes = 4 is nodes_per_rack = 4, or "
       "racks = 2 of nodes_per_rack = 2)", same=False),
    _f("n_gpus_per_node num_gpus_per_node actor_num_gpus_per_node", "verl's and OpenRLHF's",
       "devices per node", "cluster.gpus_per_node", "gpus_per_node of the cluster"),
)

_BY_NAME: dict[str, Foreign] = {}
for _entry in FOREIGN:
    for _name in _entry.names:
        assert _name not in _BY_NAME, f"{_name} is in the vocabulary twice"
        _BY_NAME[_name] = _entry


def lookup(name: str) -> Foreign | None:
    """The entry for a foreign name: whole, then its last dotted parts (``a.rollout.n``)."""
    name = name.lstrip("-")
    parts = name.split(".")
    for i in range(len(parts)):
        found = _BY_NAME.get(".".join(parts[i:]))
        if found is not None:
            return found
    return None


def foreign_hint(name: str, allowed=()) -> str | None:
    """What rpeg calls a setting another system names ``name``; None when no system does.
    ``allowed``: the keys accepted where it was written (one of them may be rpeg's)."""
    entry = lookup(name)
    if entry is None:
        return None
    many = len(entry.names) > 1
    head = f"'{name}' is {'among ' if many else ''}{entry.systems} name{'s' if many else ''} " \
           f"for {entry.what}"
    here = [k for k in entry.keys() if k in allowed]
    if entry.same and here:
        return f"{head}; here rpeg calls it '{here[0]}'"
    return f"{head}; {entry.how}" if entry.how.startswith("rpeg ") \
        else f"{head}; in rpeg: {entry.how}"


def override_hint(name: str) -> str | None:
    """:func:`foreign_hint` for a command-line override (``actor_rollout_ref.rollout.n=8``),
    with rpeg's override of the same key where there is one (``workload.samples=...``)."""
    hint = foreign_hint(name)
    if hint is None:
        return None
    paths = [p for p in (_override_path(r) for r in lookup(name).rpeg) if p]
    return hint + (f"; on the command line: {' or '.join(p + '=...' for p in paths)}"
                   if paths else "")


def _override_path(ref: str) -> str | None:
    """The override that sets rpeg key ``ref`` (rpeg.spec.overrides), if one does."""
    from rpeg.spec.functions import find
    from rpeg.spec.registry import Category

    if "." not in ref:
        return None
    owner, key = ref.split(".")
    if owner in ("workload", "data"):
        return f"workload.{key}"
    if owner in ("eval", "log"):
        return f"{owner}.{key}"
    if owner in ("model", "architecture"):
        return f"model.NAME.{key}"
    if owner == "lora":
        return f"model.NAME.lora.{key}"
    fn = find(owner)
    if fn is None:
        return None
    if fn.category is Category.OPTIMIZER:
        return f"model.NAME.optimizer.{key}"
    if fn.category in (Category.STAGE, Category.ESTIMATOR):
        return f"stage.NAME.{key}"
    return None


__all__ = ["FOREIGN", "Foreign", "STATEMENTS", "foreign_hint", "lookup", "override_hint"]
