"""The registry's preconditions, as the functions declare them: each rule's name and what
must hold.

    >>> [r.name for r in GENERATE][:3]
    ['refill_groups', 'refill_scores', 'greedy_groups']

A function of the registry (``rpeg.spec.functions``) lists its rules; ``rpeg.spec.rules``
checks each against the whole pipeline, by name (``rules.CHECKS``), and ``rpeg help
functions`` prints them. Declared apart from their checks so the registry imports nothing
that reads it.
"""

from __future__ import annotations

from rpeg.spec.registry import Rule

GENERATE = (
    Rule("refill_groups", "refill_rounds needs samples >= 2 (groups to compare)"),
    Rule("refill_scores", "refill_rounds needs a python reward's score stage on the responses "
         "that an estimator adds up"),
    Rule("greedy_groups", "temperature > 0 where a group estimator compares a prompt's "
         "samples (greedy samples are all one response)"),
    Rule("greedy_policy", "temperature > 0 for responses a policy loss learns from"),
    Rule("top_p_greedy", "top_p only with temperature > 0"),
    Rule("kv_fraction_engine", "kv_fraction not with engine = torch (which takes no share "
         "of the memory: it decodes in waves of max_num_seqs)"),
    Rule("top_p_engine", "warning: top_p < 1 under vLLM without tis on the loss starts the "
         "ratios below 1"),
)
MODEL_PASS = (
    Rule("untrained_head", "a value or reward head nothing trains comes from weights that "
         "hold it"),
    Rule("random_reference", "a frozen language model without weights only where the policy "
         "is the same seed initialisation"),
    Rule("one_vocabulary", "the model reads token ids of the generating model's vocabulary"),
)
SCORE = (Rule("weight_summed", "weight only on scores an estimator adds up"),) + \
    MODEL_PASS[:1] + MODEL_PASS[2:]
TRAIN = (
    Rule("minibatches_fit", "minibatches at most the step's responses"),
    Rule("own_samples", "a policy loss trains on responses its own model generated"),
    MODEL_PASS[2],
)
GROUPS = (Rule("group_samples", "samples >= 2 per prompt (and reinforce's baseline = group)"),)
REMAX = (Rule("greedy_baseline", "baseline, given: scores of a generate stage with "
                                  "temperature = 0"),)
GROUP_NORM = GROUPS + (Rule("std_keywords", "eps and correction only with std = true"),)
POLICY_LOSS = (Rule("k1_loss", "warning: a KL loss term estimated with k1 (its expected "
                    "gradient is 0)"),
               Rule("clip_shadowed", "clip not with both clip_low and clip_high (which "
                    "replace it on each side)"))
OVERLONG = (Rule("overlong_reaches", "the penalty starts below the longest response, "
                 "buffer below max_len"),)
PYTHON = (Rule("reward_signature", "the function takes what rpeg passes: (prompts, responses, "
                "answers, **columns), or verl's compute_score(data_source, solution_str, "
                "ground_truth, extra_info)"),)
OPTIMIZER = (
    Rule("warmup_within_run", "warmup shorter than the run"),
    Rule("min_lr_below_lr", "a decaying schedule's min_lr below lr"),
)
