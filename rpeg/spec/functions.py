"""The registry: every function of the language, once (see ``rpeg.spec.registry``).

    >>> [f.name for f in by_category(Category.ESTIMATOR)]
    ['gae', 'group_norm', 'rloo', 'reinforce', 'remax']
    >>> function("grpo").policy, function("value_mse").trains.value
    (True, 'value')

A new algorithm is one entry here plus its implementation in each backend
(``backends/torch_backend/algorithms.py`` registers them by name) and its tests;
nothing else in rpeg matches names. Defaults, ranges and units are the
language reference (``rpeg help functions``).
"""

from __future__ import annotations

from rpeg.spec import preconditions as R
from rpeg.spec.kinds import DEFAULT_TURNS, FORMATS, GENERATE_ENGINES, Engine, Head, OpKind
from rpeg.spec.registry import (
    Category,
    Function,
    Param,
    Pricing,
    Role,
    Scope,
    Slot,
    Target,
    Type,
)

KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
SCHEDULES = ("constant", "linear", "cosine")
CLIP_FRACS = ("binding", "outside")

_KL_ROLES = (Role.LOGPROBS, Role.REF_LOGPROBS)


def _kl(where: str) -> Param:
    return Param("kl", Type.REAL, f"coefficient of the KL penalty to the reference model {where}",
                 default=0.0, low=0.0, high=1e3, needs=_KL_ROLES)


def _kl_estimator(default: str) -> Param:
    return Param("kl_estimator", Type.CHOICE,
                 "how the KL is estimated per token from log-probabilities: k1 = log p - log "
                 "p_ref, k2 = (log p - log p_ref)^2 / 2, k3 = p_ref/p - log(p_ref/p) - 1 "
                 "(non-negative, low variance; exact: not clamped, where verl's low_var_kl "
                 "clamps it to [-10, 10])", default=default, choices=KL_ESTIMATORS,
                 requires="kl")


_KL_TARGET = Param("kl_target", Type.REAL,
                   "adaptive KL: the coefficient starts at kl and after each step is multiplied "
                   "by 1 + clip(KL / kl_target - 1, -0.2, 0.2) x responses / kl_horizon",
                   low=0.0, low_open=True, high=1e3, requires="kl")
_KL_HORIZON = Param("kl_horizon", Type.REAL, "responses over which the adaptive coefficient "
                    "moves by up to 20%", default=10000.0, unit="responses", low=1.0, high=1e12,
                    requires="kl_target")

# Gamma of a discounted estimator.
_GAMMA = Param("gamma", Type.REAL, "discount per token", default=1.0, low=0.0, high=1.0)


def _policy_params(clip: float, agg: str, whiten: bool) -> tuple[Param, ...]:
    return (
        Param("clip", Type.REAL, "clipping range of the importance ratio: [1 - clip, 1 + clip]",
              default=clip, low=0.0, high=1.0, low_open=True, high_open=True),
        Param("clip_low", Type.REAL, "lower clipping range (the ratio is clipped below at "
              "1 - clip_low)", derived="clip", low=0.0, high=1.0, low_open=True,
              high_open=True),
        Param("clip_high", Type.REAL, "upper clipping range (the ratio is clipped above at "
              "1 + clip_high; DAPO's clip-higher: 0.28)", derived="clip", low=0.0, high=10.0,
              low_open=True),
        Param("dual_clip", Type.REAL, "dual-clip: for negative advantages the loss is bounded "
              "by dual_clip x |advantage|", low=1.0, high=1e3, low_open=True),
        Param("agg", Type.CHOICE, "how token losses become the batch's loss: token_mean "
              "(every token weighs the same: DAPO), seq_mean_token_mean (each response "
              "weighs the same), seq_mean_token_sum (token sums over the responses times the "
              "generation budget: Dr. GRPO, TRL's dr_grpo; verl's seq-mean-token-sum does "
              "not divide by the budget)", default=agg, choices=AGGREGATIONS),
        Param("entropy", Type.REAL, "coefficient of the entropy bonus", default=0.0, low=0.0,
              high=10.0),
        _kl("as a loss term (GRPO)"),
        _kl_estimator("k3"),
        _KL_TARGET,
        _KL_HORIZON,
        Param("whiten", Type.BOOL, "normalise the advantages over the batch (mean 0, std 1) "
              "before the loss", default=whiten),
        Param("tis", Type.REAL, "truncated importance sampling: recompute the behaviour "
              "policy's log-probabilities with the trainer on every batch and weight each "
              "token by min(p_trainer / p_generator, tis) (engines differ from the trainer); "
              "without it only responses sampled with older weights are corrected, capped "
              "at 2", low=1.0, high=1e3, priced=True),
        Param("coef", Type.REAL, "weight of this loss in a shared backbone's sum", default=1.0,
              low=0.0, high=1e3, low_open=True),
        Param("clip_frac", Type.CHOICE, "what the clip_frac metric counts, per response "
              "token: binding = the tokens where the clip binds (the ratio above 1 + "
              "clip_high with a positive advantage, below 1 - clip_low with a negative one: "
              "verl's pg_clipfrac, TRL's clip_ratio); outside = every token whose ratio is "
              "outside the band, whatever its advantage (rpeg's earlier default)",
              default="binding", choices=CLIP_FRACS),
    )


_POLICY_INPUTS = (Slot(Role.ADVANTAGES), Slot(Role.LOGPROBS, required=False),
                  Slot(Role.REF_LOGPROBS, required=False))

_LOSSES = (
    Function(
        "ppo_clip", Category.LOSS,
        "PPO's clipped surrogate objective on per-token importance ratios.",
        _policy_params(0.2, "token_mean", True), inputs=_POLICY_INPUTS,
        pricing=Pricing.IN_TRAINING, positional=("clip",), trains=Head.LM, policy=True,
        rules=R.POLICY_LOSS),
    Function(
        "grpo", Category.LOSS,
        "GRPO's objective: the clipped surrogate on group-normalised advantages (not "
        "whitened again), usually with the KL to the reference as a loss term.",
        _policy_params(0.2, "token_mean", False), inputs=_POLICY_INPUTS,
        pricing=Pricing.IN_TRAINING, positional=("clip",), trains=Head.LM, policy=True,
        rules=R.POLICY_LOSS),
    Function(
        "gspo", Category.LOSS,
        "GSPO: one importance ratio per response, the geometric mean of its tokens' ratios, "
        "clipped at the sequence level.",
        _policy_params(4e-4, "seq_mean_token_mean", False), inputs=_POLICY_INPUTS,
        pricing=Pricing.IN_TRAINING, positional=("clip",), trains=Head.LM, policy=True,
        rules=R.POLICY_LOSS),
    Function(
        "value_mse", Category.LOSS,
        "Squared error of the value head against the returns, optionally clipped around the "
        "old values.",
        (Param("clip", Type.REAL, "value clipping: the new value may move at most clip from "
               "the old one", derived="0.2 with the old values as an input, else none",
               low=0.0, high=1e6, off=0.0, needs=(Role.VALUES,)),
         Param("coef", Type.REAL, "weight of this loss in a shared backbone's sum",
               derived="1, or 0.5 beside a policy loss on a shared backbone", low=0.0,
               high=1e3, low_open=True)),
        inputs=(Slot(Role.RETURNS), Slot(Role.VALUES, required=False)),
        pricing=Pricing.IN_TRAINING, positional=("clip",), trains=Head.VALUE),
)

# A generate stage's conversation with tools or an environment (rpeg.spec.tools).
_TURN_PARAMS = (
    Param("tools", Type.NAMES, "tools the policy may call (tool NAME = python(...)): a call in "
          "a turn runs the tool in a sandbox, and its result (or the error) is the next "
          "observation", priced=True),
    Param("environment", Type.NAME, "an environment (environment NAME = python(\"module:"
          "Class\")) the conversation steps: each turn's text is an action, its observation "
          "follows until the environment says done", priced=True),
    Param("max_turns", Type.INT, "most policy turns per sample; a turn ends at a tool call, "
          "or the conversation at the end of a response", derived=f"{DEFAULT_TURNS} with tools "
          "or an environment", unit="turns", low=1, high=64, priced=True),
    Param("format", Type.CHOICE, "how a tool call is written and its observation wrapped: rpeg "
          "(<NAME>ARGUMENT</NAME>, then <result>TEXT</result>), hermes (ChatML of Qwen2.5, "
          "Qwen3, SmolLM: <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>, then "
          "a user turn's <tool_response>), llama3 ({\"name\": ..., \"parameters\": ...}, "
          "then an ipython turn), mistral ([TOOL_CALLS][...], then [TOOL_RESULTS]...)",
          default="rpeg", choices=FORMATS),
    Param("max_obs_len", Type.INT, "most tokens of the tool's (or environment's) text in one "
          "observation: a longer one is cut and ends with a truncation marker; the format's "
          "wrapper around it (<result>...</result>, a tool_response turn) adds its own few",
          default=256, unit="tokens", low=1, high=1 << 20,
          priced=True),
    Param("max_total_len", Type.INT, "most tokens of a conversation after its prompt, policy "
          "and observation tokens together: it ends when they are reached",
          derived="max_turns x (max_len + max_obs_len)", unit="tokens", low=1, high=1 << 21,
          priced=True),
    Param("turns", Type.LENGTH, "policy turns per sample, the distribution the cost model "
          "prices (e.g. uniform(min = 1, max = 4))", derived="max_turns", unit="turns",
          priced=True),
    Param("obs_len", Type.LENGTH, "observation tokens per tool call, the distribution the "
          "cost model prices", derived="max_obs_len", unit="tokens", priced=True),
)

_STAGES = (
    Function(
        "generate", Category.STAGE, "Sample one response per prompt and sample; with tools or "
        "an environment, a conversation: turns of the policy's tokens, each followed by an "
        "observation (the tool's result), masked out of the loss, the KL and token counts.",
        (Param("temperature", Type.REAL, "sampling temperature (0: greedy). The behaviour "
               "policy is log_softmax(logits / temperature) over the whole vocabulary, and "
               "every logprob of the stage's responses is of it: the engine's, the old-policy "
               "and reference forwards' and the trainer's (a greedy stage's: at 1), so a "
               "synchronous first update has importance ratio 1", default=1.0,
               low=0.0, high=100.0),
         Param("top_p", Type.REAL, "nucleus sampling: the smallest set of tokens whose "
               "probability reaches top_p. It limits what is sampled, not the policy the "
               "losses compare with, which stays the whole vocabulary's at the temperature "
               "(as verl's and TRL's trainers compute it): the torch engine reports those "
               "logprobs; vLLM reports the nucleus's, renormalised, so under vLLM with top_p "
               "< 1 the ratio starts below 1 by the nucleus's mass unless the loss sets tis, "
               "which recomputes the behaviour logprobs with the trainer and weights each "
               "token by min(p / q, tis)", default=1.0, low=0.0, high=1.0, low_open=True),
         Param("max_len", Type.INT, "most tokens a response (with tools: a turn) may have (at "
               "most the workload's gen_len max)", derived="the workload's gen_len max",
               unit="tokens", low=1,
               priced=True),
         Param("min_len", Type.INT, "tokens a response has before it may end: "
               "end-of-sequence is not sampled earlier", unit="tokens", low=1, priced=True),
         Param("max_num_seqs", Type.INT, "sequences the engine decodes at once (vLLM's "
               "max_num_seqs; the torch engine decodes in waves of this many)",
               derived="all of the device's share", unit="sequences", low=1, priced=True),
         Param("kv_fraction", Type.REAL, "share of a device's memory the engine may take "
               "(vLLM's gpu_memory_utilization)", derived="the share rpeg's vLLM takes",
               low=0.0, high=1.0, low_open=True, priced=True),
         Param("engine", Type.CHOICE, "the generation engine (auto: the planner chooses)",
               default=Engine.AUTO, choices=tuple(e.value for e in GENERATE_ENGINES), priced=True),
         Param("refill_rounds", Type.INT, "dynamic sampling (DAPO): groups whose rewards are "
               "all equal are replaced by new prompts' groups, in at most this many extra "
               "generation rounds", default=0, low=0, high=16, unit="rounds", priced=True),
         Param("filter_rate", Type.REAL, "expected fraction of groups dynamic sampling "
               "filters out each round (what the cost model prices the extra rounds by)",
               default=0.5, low=0.0, high=1.0, high_open=True, requires="refill_rounds",
               priced=True)) + _TURN_PARAMS,
        kind=OpKind.GENERATE, target=Target.LM, inputs=(Slot(Role.PROMPTS),),
        outputs=(Role.RESPONSES, Role.LOGPROBS), pricing=Pricing.GENERATION, rules=R.GENERATE,
        moved=(("chunks", "streaming is the plan's choice: place STAGE on gpus A..B "
                          "{ chunks = N }"),
               ("microbatch", "the plan's choice: place STAGE on gpus A..B "
                              "{ microbatches = N }"))),
    Function(
        "forward", Category.STAGE,
        "One forward pass over the responses: log-probabilities of a language model "
        "(reference log-probabilities when it is frozen), values of a value head, scores of "
        "a reward head.", (), kind=OpKind.FORWARD, target=Target.MODEL,
        inputs=(Slot(Role.RESPONSES),), outputs_from_head=True, pricing=Pricing.MODEL_PASS,
        rules=R.MODEL_PASS,
        moved=(("microbatch", "the plan's choice: place STAGE on gpus A..B "
                              "{ microbatches = N }"),)),
    Function(
        "score", Category.STAGE,
        "One reward per response, from a reward (python, overlong) or a model with "
        "head = reward. Several score stages read by one estimator add up, each times its "
        "weight.",
        (Param("weight", Type.REAL, "weight of these scores where an estimator adds several",
               default=1.0, low=-1e6, high=1e6),),
        kind=OpKind.SCORE, target=Target.SCORER, inputs=(Slot(Role.RESPONSES),),
        outputs=(Role.SCORES,), pricing=Pricing.SCORING, rules=R.SCORE),
    Function(
        "train", Category.STAGE,
        "Update a model on the step's responses: one optimizer step per minibatch, epochs "
        "times; the loss says what it reads.",
        (Param("loss", Type.CALL, "the loss (see losses)",
               derived="value_mse for a value head, else ppo_clip",
               choices=tuple(f.name for f in _LOSSES)),
         Param("minibatches", Type.INT, "optimizer steps per epoch (the batch split evenly)",
               default=1, low=1, priced=True),
         Param("epochs", Type.INT, "passes over the step's batch", default=1, low=1, high=1000,
               priced=True)),
        kind=OpKind.TRAIN, target=Target.TRAINABLE, inputs=(Slot(Role.RESPONSES),),
        pricing=Pricing.TRAINING, rules=R.TRAIN,
        moved=(("grad_clip", "set it on the model's optimizer: optimizer = adam(lr = ..., "
                             "grad_clip = 1.0)"),
               ("kl", "a KL loss term belongs to the loss: loss = grpo(0.2, kl = 0.01)"),
               ("entropy", "the entropy bonus belongs to the loss: loss = ppo_clip(0.2, "
                           "entropy = 0.001)"),
               ("value_clip", "value clipping belongs to the loss: loss = value_mse(clip = "
                              "0.2)"),
               ("is_cap", "the importance-weight cap belongs to the loss: loss = "
                          "ppo_clip(0.2, tis = 2)"),
               ("microbatch", "the plan's choice: place STAGE on gpus A..B "
                              "{ microbatches = N }"))),
)

# An adaptive coefficient keeps state across steps, which the trainer holds (and checkpoints);
# an estimator is a pure function of its step's data.
_ADAPTIVE_IN_LOSS = (("kl_target", "an adaptive KL coefficient needs the KL in the loss: "
                                   "loss = grpo(0.2, kl = 0.01, kl_target = 0.02)"),)
_OUTCOME = (Slot(Role.SCORES, many=True), Slot(Role.LOGPROBS, required=False),
            Slot(Role.REF_LOGPROBS, required=False))

_ESTIMATORS = (
    Function(
        "gae", Category.ESTIMATOR,
        "Generalised advantage estimation (PPO): per-token advantages and returns from the "
        "scores (on each response's last token), the values and the KL penalty.",
        (_kl("in the token rewards (PPO-RLHF)"), _kl_estimator("k1"), _GAMMA,
         Param("lam", Type.REAL, "GAE's lambda: bias-variance trade-off", default=0.95,
               low=0.0, high=1.0)),
        kind=OpKind.COMPUTE,
        inputs=(Slot(Role.SCORES, many=True), Slot(Role.VALUES), Slot(Role.LOGPROBS, False),
                Slot(Role.REF_LOGPROBS, False)),
        outputs=(Role.ADVANTAGES, Role.RETURNS), pricing=Pricing.PER_TOKEN,
        scope=Scope.SAMPLE, moved=_ADAPTIVE_IN_LOSS),
    Function(
        "group_norm", Category.ESTIMATOR,
        "GRPO: each score minus its prompt group's mean, over the group's standard deviation "
        "(std = false: not scaled, Dr. GRPO); a KL in the reward is subtracted per token "
        "afterwards, as a reward-to-go.",
        (_kl("in the token rewards"), _kl_estimator("k1"),
         Param("std", Type.BOOL, "divide by the group's standard deviation (false: Dr. GRPO)",
               default=True),
         Param("correction", Type.INT, "Bessel's correction of the group's standard "
               "deviation: squared deviations are summed over n - correction (1: the sample "
               "standard deviation, torch.std's, as verl and TRL compute it; 0: the population "
               "one, rpeg's earlier default)", default=1, low=0, high=1),
         Param("eps", Type.REAL, "added to the standard deviation", default=1e-6, low=0.0,
               high=1e3, low_open=True)),
        kind=OpKind.COMPUTE, inputs=_OUTCOME, outputs=(Role.ADVANTAGES,),
        pricing=Pricing.PER_SAMPLE, scope=Scope.GROUP, min_samples=2, reads_responses=True,
        moved=_ADAPTIVE_IN_LOSS, rules=R.GROUP_NORM),
    Function(
        "rloo", Category.ESTIMATOR,
        "REINFORCE leave-one-out: each score minus the mean of its group's other scores.",
        (_kl("in the token rewards"), _kl_estimator("k1")),
        kind=OpKind.COMPUTE, inputs=_OUTCOME, outputs=(Role.ADVANTAGES,),
        pricing=Pricing.PER_SAMPLE, scope=Scope.GROUP, min_samples=2, reads_responses=True,
        moved=_ADAPTIVE_IN_LOSS, rules=R.GROUPS),
    Function(
        "reinforce", Category.ESTIMATOR,
        "REINFORCE++: per-token discounted returns of the scores and the KL penalty, "
        "normalised over the whole batch (baseline = group: the group's mean score is "
        "subtracted first).",
        (_kl("in the token rewards"), _kl_estimator("k1"), _GAMMA,
         Param("baseline", Type.CHOICE, "subtract a per-prompt baseline (the group's mean "
               "score) before the batch normalisation", default="none",
               choices=("none", "group"))),
        kind=OpKind.COMPUTE, inputs=_OUTCOME, outputs=(Role.ADVANTAGES,),
        pricing=Pricing.PER_TOKEN, scope=Scope.BATCH, reads_responses=True,
        moved=_ADAPTIVE_IN_LOSS, rules=R.GROUPS),
    Function(
        "remax", Category.ESTIMATOR,
        "ReMax: each score minus the score of a greedy response to the same prompt.",
        (Param("baseline", Type.DATA, "scores of greedy responses to the same prompts (a score "
               "stage reading a generate stage with temperature = 0)", needs=(Role.SCORES,),
               required=True),
         _kl("in the token rewards"), _kl_estimator("k1")),
        kind=OpKind.COMPUTE, inputs=_OUTCOME, outputs=(Role.ADVANTAGES,),
        pricing=Pricing.PER_SAMPLE, scope=Scope.GROUP, reads_responses=True,
        moved=_ADAPTIVE_IN_LOSS, rules=R.REMAX),
)

_REWARDS = (
    Function(
        "python", Category.REWARD,
        "A python function next to the file that names it (or on the Python path): "
        "f(prompts, responses, answers, **columns) -> one float per response, once a batch; "
        "or verl's compute_score(data_source, solution_str, ground_truth, extra_info=None) "
        "-> a float (or a dict with its score), once a response, ground_truth the answer and "
        "the other parameters the row's columns by name. rpeg check reads its signature "
        "against what rpeg passes and the dataset's columns.",
        (Param("ref", Type.STRING, '"module:function"'),
         Param("on_error", Type.CHOICE, "what an exception in the reward (or a score that is "
               "not finite) does: stop = the run stops at that step, before any update reads "
               "the scores; zero = the responses it failed on score 0, counted in the "
               "metrics (reward_errors.STAGE)", default="stop", choices=("stop", "zero"))),
        positional=("ref",), pricing=Pricing.SCORING, user_code=True, rules=R.PYTHON),
    Function(
        "overlong", Category.REWARD,
        "DAPO's overlong shaping: 0 up to max_len - buffer tokens, then falling linearly to "
        "-1 at max_len; add it to a task reward with a second score stage. A response's "
        "length is its tokens; a conversation's, every token after its prompt, the "
        "policy's and the observations' together (as verl measures a multi-turn response).",
        (Param("max_len", Type.INT, "length of the full penalty",
               derived="the generate stage's max_len (a conversation's max_total_len)",
               unit="tokens", low=1),
         Param("buffer", Type.INT, "length of the band over which the penalty grows",
               derived="a quarter of max_len", unit="tokens", low=1)),
        pricing=Pricing.HOST, rules=R.OVERLONG),
)


def _sandbox(what: str, code: str) -> tuple[Param, ...]:
    """The keywords of a tool or environment: its code and the sandbox each call runs in."""
    return (
        Param("ref", Type.STRING, f'"module:{code}" next to the spec (or on the Python path)'),
        Param("timeout", Type.QUANTITY, f"wall-clock time one {what} may take; past it the call "
              "is killed and the policy sees an error", default=5.0, unit="s", low=1e-3,
              high=3600.0),
        Param("memory", Type.QUANTITY, f"memory one {what} may allocate (an address-space limit "
              "beyond what the loaded module holds)", default=1e9, unit="bytes", low=1e6,
              high=1e13),
        Param("max_output", Type.QUANTITY, f"bytes of text one {what} may return or print; more "
              "is an error", default=65536.0, unit="bytes", low=16.0, high=1e9),
        Param("cores", Type.INT, f"host cores one {what} takes of those the cluster gives tool "
              "executors (tool_cores)", default=1, low=1, high=1024, priced=True),
        Param("latency", Type.LATENCY, f"how long one {what} takes, the distribution the cost "
              "model prices (rpeg calibrate --tools measures it)",
              derived="the profile's measured sandbox call time", unit="s", priced=True),
    )


_TOOLS = (
    Function(
        "python", Category.TOOL,
        "A python function next to the spec (or on the Python path): f(text) -> observation "
        "text, called with a tool call's argument text. Each call runs in a sandbox: a "
        "process of its own with a wall-clock timeout, CPU and memory limits, a scratch "
        "directory it cannot write outside, a cleared environment and no inherited file "
        "descriptors; a failure, timeout or oversized output is an error observation.",
        _sandbox("call", "function"), positional=("ref",), pricing=Pricing.TOOL,
        user_code=True),
)

_ENVIRONMENTS = (
    Function(
        "python", Category.ENVIRONMENT,
        "A python class next to the spec (or on the Python path), one instance per sample in "
        "a sandboxed process of its own: reset(prompt, row) once, then step(action) -> "
        "observation text, or (observation, done), per policy turn.",
        _sandbox("step", "Class"), positional=("ref",), pricing=Pricing.TOOL,
        user_code=True),
)


def _optimizer(name: str, doc: str, weight_decay: float) -> Function:
    return Function(
        name, Category.OPTIMIZER, doc,
        (Param("lr", Type.REAL, "peak learning rate", default=1e-5, low=0.0, high=1.0,
               low_open=True, high_open=True),
         Param("beta1", Type.REAL, "first-moment decay", default=0.9, low=0.0, high=1.0,
               high_open=True),
         Param("beta2", Type.REAL, "second-moment decay", default=0.999, low=0.0, high=1.0,
               high_open=True),
         Param("weight_decay", Type.REAL, "weight decay", default=weight_decay, low=0.0,
               high=10.0),
         Param("eps", Type.REAL, "added to the second moment's root", default=1e-8, low=0.0,
               high=1.0, low_open=True),
         Param("grad_clip", Type.REAL, "clip the gradient's global norm to this (0: no "
               "clipping)", default=1.0, low=0.0, high=1e6),
         Param("schedule", Type.CHOICE, "learning rate over the run's steps after warmup: "
               "constant, linear or cosine decay to min_lr at the last step",
               default="constant", choices=SCHEDULES),
         Param("warmup", Type.INT, "steps over which the learning rate rises linearly to lr",
               default=0, low=0, unit="steps"),
         Param("min_lr", Type.REAL, "learning rate a decaying schedule ends at", default=0.0,
               low=0.0, high=1.0, requires="schedule"),
         Param("master_weights", Type.BOOL, "a 16-bit model's Adam updates float32 master "
               "weights (false: 16-bit moments and no master copy, 4 bytes a parameter less)",
               default=True, priced=True)),
        positional=("lr",), pricing=Pricing.OPTIMIZER, rules=R.OPTIMIZER)


_OPTIMIZERS = (
    _optimizer("adam", "Adam (weight decay as an L2 term of the gradient).", 0.0),
    _optimizer("adamw", "AdamW (decoupled weight decay).", 0.01),
)

FUNCTIONS: tuple[Function, ...] = (_STAGES + _ESTIMATORS + _LOSSES + _REWARDS + _OPTIMIZERS
                                   + _TOOLS + _ENVIRONMENTS)
# A declaration's kinds (tool, environment) may share a name with a function (python):
# ``function`` finds the function, ``declared`` the kind.
_DECLARED = (Category.TOOL, Category.ENVIRONMENT)
_BY_NAME = {f.name: f for f in FUNCTIONS if f.category not in _DECLARED}
_BY_KIND = {(f.category, f.name): f for f in FUNCTIONS}
assert len(_BY_NAME) + sum(f.category in _DECLARED for f in FUNCTIONS) == len(FUNCTIONS), \
    "registry names must be unique"
assert len(_BY_KIND) == len(FUNCTIONS), "names must be unique within a category"


def function(name: str) -> Function:
    """The entry named ``name``; KeyError when there is none."""
    return _BY_NAME[name]


def find(name: str) -> Function | None:
    return _BY_NAME.get(name)


def declared(category: Category, name: str) -> Function | None:
    """The kind ``name`` of a declaration of ``category`` (a tool's python, ...)."""
    return _BY_KIND.get((category, name))


def by_category(category: Category) -> tuple[Function, ...]:
    return tuple(f for f in FUNCTIONS if f.category is category)


def stage_functions() -> tuple[Function, ...]:
    """What a ``stage NAME = FUNCTION(...)`` may call: the stage functions and estimators."""
    return tuple(f for f in FUNCTIONS if f.kind is not None)


def loss_for(head) -> Function | None:
    """The loss a train stage of a model with ``head`` gets when it names none: the
    registry's first that trains that head."""
    return next((f for f in by_category(Category.LOSS) if f.trains is head), None)


def loss_of(stage, pipeline) -> Function:
    """A train stage's loss: the one it names, else its model's head's default."""
    loss = stage.param("loss")
    if loss is not None:
        return function(loss.name)
    return loss_for(pipeline.model(stage.target).head)


def default_optimizer() -> Function:
    """The optimizer of a trainable model that names none: the registry's first."""
    return by_category(Category.OPTIMIZER)[0]


def kind_of(name: str) -> OpKind | None:
    f = _BY_NAME.get(name)
    return f.kind if f else None
