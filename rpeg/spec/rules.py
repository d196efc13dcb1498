"""The registry's preconditions: what must hold for a function's call to take effect.

    >>> from rpeg.spec.functions import function
    >>> [r.name for r in function("generate").rules][:3]
    ['refill_groups', 'refill_scores', 'greedy_groups']

A spec can be well-typed and still compute nothing useful: a GRPO group sampled greedily
(every advantage 0), a reward model whose head nothing trained (every score 0), a KL to a
reference that is a random initialisation, more minibatches than responses, a warmup
longer than the run. Each such precondition is one :class:`~rpeg.spec.registry.Rule` of
the function it belongs to (``rpeg.spec.functions``, declared in
``rpeg.spec.preconditions``) or of a section (``rpeg.spec.checks.SECTION_RULES``), checked
here by its name (``CHECKS``) against the whole pipeline (:class:`Site`) and refused at
the text that breaks it, with a hint. A check's signature is ``check(site, subject)``:
``subject`` is the stage calling the function (a loss: its train stage), the reward, the
model whose optimizer it is, or nothing for a section. A rule whose
breach leaves a run still meaningful returns a SpecWarning instead. ``rpeg help
functions`` lists each function's rules; each has a golden error test.
"""

from __future__ import annotations

import json
import struct
from functools import cached_property
from pathlib import Path

import attrs

from rpeg.errors import Span, SpecError, SpecWarning
from rpeg.spec import ast
from rpeg.spec.kinds import Engine, Head, OpKind
from rpeg.spec.registry import Category, Role, Rule, Type
from rpeg.spec.tools import conversation


@attrs.frozen
class Site:
    """The pipeline being checked, with the syntax it came from (for spans)."""

    items: tuple
    workload: object
    models: tuple
    rewards: tuple
    stages: tuple
    shares: tuple = ()
    evaluation: object = None

    @cached_property
    def targets(self) -> dict:
        return {m.name: m for m in self.models} | {r.name: r for r in self.rewards}

    @cached_property
    def roles(self) -> dict[str, Role]:
        from rpeg.spec.stages import roles_of
        return roles_of(self.stages, self.targets)

    def decl(self, stage: str) -> ast.StageDecl:
        return next(i for i in self.items if isinstance(i, ast.StageDecl)
                    and i.name.value == stage)

    def producer(self, data: str):
        return next((s for s in self.stages if data in s.outputs), None)

    def generator(self, responses: str):
        """The generate stage that made ``responses`` (None when none did)."""
        src = self.producer(responses)
        return src if src is not None and src.kind is OpKind.GENERATE else None

    def readers(self, data: str) -> list:
        return [s for s in self.stages if data in s.inputs]

    def model(self, name: str | None):
        from rpeg.spec.model import Model
        m = self.targets.get(name or "")
        return m if isinstance(m, Model) else None

    def trained(self, model: str) -> bool:
        """Whether a stage trains ``model`` (or a model whose backbone it may share)."""
        group = next((g for g in self.shares if model in g), (model,))
        return any(s.kind is OpKind.TRAIN and s.target in group for s in self.stages)

    def shared(self, a: str, b: str) -> bool:
        return a == b or any(a in g and b in g for g in self.shares)

    def responses_of(self, stage) -> str | None:
        """The responses ``stage`` reads."""
        return next((n for n in stage.inputs if self.roles.get(n) is Role.RESPONSES), None)

    def policy_trainers(self, responses: str) -> list:
        """Train stages whose policy loss learns from ``responses``."""
        from rpeg.spec.functions import function
        return [s for s in self.readers(responses) if s.kind is OpKind.TRAIN
                and function(s.param("loss").name).policy]

    def key_span(self, stage, key: str) -> Span:
        """Where ``stage``'s keyword ``key`` is written (its call when it is not)."""
        from rpeg.spec.functions import function
        from rpeg.spec.stages import _key_span
        call = self.decl(stage.name).call
        return _key_span(call, key, function(stage.function)) or call.span

    def loss_span(self, stage, key: str) -> Span:
        """Where a train stage's loss keyword ``key`` is written (the loss, else the call)."""
        from rpeg.spec.functions import function
        from rpeg.spec.stages import _key_span
        call = self.decl(stage.name).call
        kw = call.kwarg("loss")
        if kw is None or not isinstance(kw.value, ast.Call):
            return call.span
        return _key_span(kw.value, key, function(kw.value.func.value)) or kw.value.span

    def arg_span(self, stage, name: str) -> Span:
        from rpeg.spec.stages import _arg_span
        return _arg_span(self.decl(stage.name), name)

    def entry(self, decl_type, key: str, name: str | None = None):
        """The entry ``key`` of a block (a model's: ``name``), or None."""
        for i in self.items:
            if not isinstance(i, decl_type) or (name and i.name.value != name):
                continue
            block = i.block
            for e in block.entries if block is not None else ():
                if not isinstance(e, ast.Section) and e.key.value == key:
                    return e
        return None

    def optimizer_span(self, model, key: str) -> Span:
        """Where a model's optimizer keyword ``key`` is written (the model when it is not)."""
        e = self.entry(ast.ModelDecl, "optimizer", model.name)
        if e is None or not isinstance(e, ast.Assign) or not isinstance(e.value, ast.Call):
            return model.span
        kw = e.value.kwarg(key)
        return kw.span if kw is not None else e.value.span


def check_rules(site: Site) -> list[SpecError]:
    """Every rule of every function the pipeline calls, and of its sections: raises the
    first broken one; returns the warnings."""
    from rpeg.spec.checks import SECTION_CHECKS, SECTION_RULES
    from rpeg.spec.functions import function
    warnings: list[SpecError] = []
    checks = CHECKS | SECTION_CHECKS

    def run(rule: Rule, subject) -> None:
        problem = checks[rule.name](site, subject)
        if problem is None:
            return
        if isinstance(problem, SpecWarning):
            warnings.append(problem)
            return
        raise problem

    for rule in SECTION_RULES:
        run(rule, None)
    for stage in site.stages:
        calls = [function(stage.function)]
        if stage.kind is OpKind.TRAIN:
            calls.append(function(stage.param("loss").name))
        for fn in calls:
            for rule in fn.rules:
                run(rule, stage)
    for reward in site.rewards:
        for rule in function(reward.kind).rules:
            run(rule, reward)
    for model in site.models:
        if model.optimizer is not None and site.trained(model.name):
            for rule in function(model.optimizer.kind).rules:
                run(rule, model)
    return warnings


# --- generate ------------------------------------------------------------------------------

def _summing_groups(site: Site, stage) -> list:
    """Estimators that compare the samples of a prompt with each other, reading scores of
    ``stage``'s responses."""
    from rpeg.spec.functions import function
    responses = stage.outputs[0]
    scored = {s.outputs[0] for s in site.readers(responses) if s.kind is OpKind.SCORE}
    out = []
    for e in site.stages:
        fn = function(e.function)
        if fn.category is not Category.ESTIMATOR:
            continue
        data = {str(v) for k, v in e.params if fn.has(k) and fn.param(k).type is Type.DATA}
        grouped = fn.min_samples > 1 or (fn.has("baseline") and e.param("baseline") == "group")
        if grouped and (set(e.inputs) - data) & scored:
            out.append(e)
    return out


def greedy_groups(site: Site, stage) -> SpecError | None:
    if float(stage.arg("temperature")) > 0 or site.workload.samples < 2:
        return None
    estimators = _summing_groups(site, stage)
    if not estimators:
        return None
    e = estimators[0]
    return _sample_instead(site, stage, f"for samples {e.function}(...) compares, not 0: the "
                           f"{site.workload.samples} samples of a prompt are one greedy "
                           "response repeated, so every group's advantage is 0",
                           (f"'{e.name}' compares them here", e.span))


def greedy_policy(site: Site, stage) -> SpecError | None:
    if float(stage.arg("temperature")) > 0:
        return None
    trainers = site.policy_trainers(stage.outputs[0])
    if not trainers or _summing_groups(site, stage):
        return None
    t = trainers[0]
    return _sample_instead(site, stage, f"for responses a policy loss learns from, not 0: "
                           f"'{t.name}' trains on '{stage.outputs[0]}', and greedy responses "
                           "are not samples of the policy its ratios and gradients are of",
                           (f"'{t.name}' trains on them here", t.span))


def _sample_instead(site: Site, stage, why: str, note) -> SpecError:
    """A greedy stage whose responses must be samples: at its temperature, ``why``."""
    return SpecError(f"temperature must be above 0 {why}", site.key_span(stage, "temperature"),
                     notes=[note], hint="sample at temperature = 1.0 (a greedy stage is "
                                        "ReMax's baseline, scored, not trained on)")


def top_p_greedy(site: Site, stage) -> SpecError | None:
    if float(stage.arg("top_p")) >= 1.0 or float(stage.arg("temperature")) > 0:
        return None
    return SpecError(f"top_p must be left out of a greedy stage (temperature = 0), not "
                     f"{stage.arg('top_p'):g}: greedy decoding takes the likeliest token, "
                     "which every nucleus holds", site.key_span(stage, "top_p"),
                     hint="leave top_p out, or sample (temperature > 0)")


def _engine(stage) -> Engine:
    """A generate stage's engine keyword (auto where it names none)."""
    return Engine(stage.arg("engine"))


def kv_fraction_engine(site: Site, stage) -> SpecError | None:
    if stage.param("kv_fraction") is None or _engine(stage) is not Engine.TORCH:
        return None
    return SpecError("kv_fraction must be left out with engine = torch: the torch engine "
                     "takes no share of the memory, it decodes in waves of max_num_seqs",
                     site.key_span(stage, "kv_fraction"),
                     hint="max_num_seqs = N bounds the torch engine's waves; or engine = vllm "
                          "(or auto) for a share of the memory")


def top_p_engine(site: Site, stage) -> SpecError | None:
    from rpeg.spec.functions import function
    if float(stage.arg("top_p")) >= 1.0 or float(stage.arg("temperature")) <= 0 \
            or _engine(stage) is Engine.TORCH:
        return None
    uncorrected = [t for t in site.policy_trainers(stage.outputs[0])
                   if dict(t.param("loss").kwargs).get("tis") is None
                   and function(t.param("loss").name).has("tis")]
    if not uncorrected:
        return None
    t = uncorrected[0]
    return SpecWarning(f"top_p = {stage.arg('top_p'):g} samples from the nucleus, and "
                       f"'{t.name}' compares with the whole vocabulary's policy: a vLLM "
                       "engine reports the nucleus's renormalised logprobs, so the ratios "
                       "start below 1 by the nucleus's mass (the torch engine reports the "
                       "whole vocabulary's)", site.key_span(stage, "top_p"),
                       hint=f"set tis = 2 on '{t.name}''s loss (the trainer recomputes the "
                            "behaviour logprobs and weights each token), or engine = torch")


# --- models read by forward, score and train -------------------------------------------------

def _weight_names(folder: Path) -> set[str] | None:
    """Tensor names in a weights folder's safetensors (their headers only), or None when
    there is no folder to read yet."""
    if not folder.is_dir():
        return None
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            return set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}))
        names: set[str] = set()
        for f in sorted(folder.glob("*.safetensors")):
            with open(f, "rb") as fh:
                size = struct.unpack("<Q", fh.read(8))[0]
                if size > 1 << 28:
                    continue
                names |= set(json.loads(fh.read(size))) - {"__metadata__"}
        return names
    except (OSError, ValueError, struct.error):
        return set()


HEAD_TENSOR = "score.weight"        # transformers' *ForSequenceClassification head, one label


def untrained_head(site: Site, stage) -> SpecError | None:
    m = site.model(stage.target)
    if m is None or m.head not in (Head.VALUE, Head.REWARD) or site.trained(m.name):
        return None
    what = "score" if m.head is Head.REWARD else "value"
    if m.weights is None:
        return SpecError(f"model '{m.name}' must have weights that hold its {m.head.value} "
                         f"head, or be trained: nothing trains it, and a head built here "
                         f"starts at zero, so '{stage.name}' would read {what}s of 0 only",
                         m.span, notes=[(f"'{stage.name}' reads it here", stage.span)],
                         hint=f'weights = "FOLDER" (a sequence-classification checkpoint: '
                              f"{HEAD_TENSOR}), or train it with a value_mse stage")
    names = _weight_names(Path(m.weights))
    if names is not None and HEAD_TENSOR not in names:
        return SpecError(f"model '{m.name}''s weights folder must hold its {m.head.value} "
                         f"head ({HEAD_TENSOR}), and it holds a language model's only: "
                         f"'{stage.name}' would read {what}s of 0 only", m.span,
                         notes=[(f"'{stage.name}' reads it here", stage.span)],
                         hint="point weights at a sequence-classification checkpoint with one "
                              "label (a reward model), or train the head")
    return None


def random_reference(site: Site, stage) -> SpecError | None:
    m = site.model(stage.target)
    if m is None or m.head is not Head.LM or not m.frozen or m.weights is not None:
        return None
    gen = site.generator(site.responses_of(stage) or "")
    policy = site.model(gen.target) if gen is not None else None
    if policy is None or policy.name == m.name:
        return None
    if policy.weights is None and policy.dims == m.dims:
        return None                      # both the preset's seed initialisation: the same
    why = "has weights" if policy.weights is not None else "is another architecture"
    return SpecError(f"frozen model '{m.name}' must start where the policy '{policy.name}' "
                     f"does, and it has no weights while '{policy.name}' {why}: '{stage.name}' "
                     "would compare with a random initialisation", m.span,
                     notes=[(f"'{policy.name}' is declared here", policy.span)],
                     hint=f"give '{m.name}' the policy's weights (weights = \"...\" or the "
                          "same hf(...) folder)")


def one_vocabulary(site: Site, stage) -> SpecError | None:
    m = site.model(stage.target)
    gen = site.generator(site.responses_of(stage) or "")
    policy = site.model(gen.target) if gen is not None else None
    if m is None or policy is None or m.dims.vocab == policy.dims.vocab:
        return None
    return SpecError(f"model '{m.name}' must read token ids of the vocabulary that made "
                     f"them ({policy.dims.vocab} tokens, '{policy.name}'), not one of "
                     f"{m.dims.vocab}: '{stage.name}' reads '{gen.outputs[0]}'",
                     site.arg_span(stage, gen.outputs[0]),
                     notes=[(f"'{m.name}' is declared here", m.span)],
                     hint="use models that share the generating model's tokenizer")


# --- train ----------------------------------------------------------------------------------

def minibatches_fit(site: Site, stage) -> SpecError | None:
    k = int(stage.arg("minibatches"))
    n = site.workload.prompts * site.workload.samples
    if k <= n:
        return None
    return SpecError(f"minibatches must be at most the step's {n} responses (prompts x "
                     f"samples), not {k}: each optimizer step needs a response",
                     site.key_span(stage, "minibatches"),
                     hint=f"minibatches = {max(d for d in range(1, n + 1) if n % d == 0)} "
                          "or fewer")


def own_samples(site: Site, stage) -> SpecError | None:
    from rpeg.spec.functions import function
    if not function(stage.param("loss").name).policy:
        return None
    responses = site.responses_of(stage)
    gen = site.generator(responses or "")
    if gen is None or site.shared(gen.target, stage.target):
        return None
    return SpecError(f"a policy loss learns from its model's own samples, and '{responses}' "
                     f"were generated by '{gen.target}', not '{stage.target}': the importance "
                     "ratios would compare two different policies",
                     site.arg_span(stage, responses),
                     notes=[(f"'{gen.name}' generates them with '{gen.target}'", gen.span)],
                     hint=f"generate with {stage.target}: generate({stage.target}, prompts)")


# --- estimators and losses --------------------------------------------------------------------

def group_samples(site: Site, stage) -> SpecError | None:
    from rpeg.spec.functions import function
    from rpeg.spec.stages import _check_samples
    wl = next(i for i in site.items if isinstance(i, ast.WorkloadDecl))
    try:
        _check_samples(stage, function(stage.function), site.decl(stage.name), site.workload,
                       wl)
    except SpecError as e:
        return e
    return None


def greedy_baseline(site: Site, stage) -> SpecError | None:
    baseline = stage.param("baseline")
    if baseline is None:        # each score minus nothing: the run's advantages are NaN
        return SpecError("remax must name its baseline: the scores of greedy responses to "
                         "the same prompts", stage.span,
                         hint="a second generate stage with temperature = 0, a score stage "
                              "of its responses, and remax(scores, baseline = GREEDY_SCORES)")
    scored = site.producer(str(baseline)) if baseline is not None else None
    gen = site.generator(site.responses_of(scored) or "") if scored is not None else None
    if gen is None or float(gen.arg("temperature")) == 0:
        return None
    return SpecError(f"baseline must be scores of greedy responses (a generate stage with "
                     f"temperature = 0), and '{baseline}' scores '{gen.outputs[0]}', sampled at "
                     f"temperature {float(gen.arg('temperature')):g}",
                     site.key_span(stage, "baseline"),
                     notes=[(f"'{gen.name}' samples them here", gen.span)],
                     hint=f"set temperature = 0 on '{gen.name}'")


def std_keywords(site: Site, stage) -> SpecError | None:
    if stage.param("std") is not False:
        return None
    key = next((k for k in ("correction", "eps") if stage.param(k) is not None), None)
    if key is None:
        return None
    return SpecError(f"{key} must be left out with std = false: nothing is divided by the "
                     "group's standard deviation", site.key_span(stage, key),
                     hint=f"drop {key}, or std = true")


def k1_loss(site: Site, stage) -> SpecWarning | None:
    kwargs = dict(stage.param("loss").kwargs)
    if not kwargs.get("kl") or kwargs.get("kl_estimator") != "k1":
        return None
    return SpecWarning("kl_estimator = k1 in a loss does not pull toward the reference: "
                       "log p - log p_ref's gradient is the score function, whose mean under "
                       "the policy's own samples is 0",
                       site.loss_span(stage, "kl_estimator"),
                     hint="use k3 (the default) in the loss, or k1 in the estimator's kl "
                          "(a penalty in the reward)")


def clip_shadowed(site: Site, stage) -> SpecError | None:
    kwargs = dict(stage.param("loss").kwargs)
    if "clip" not in kwargs or "clip_low" not in kwargs or "clip_high" not in kwargs:
        return None
    return SpecError(f"clip must be left out with both clip_low and clip_high, not "
                     f"{kwargs['clip']:g}: they replace it below and above 1, so it bounds "
                     "nothing", site.loss_span(stage, "clip"),
                     hint="drop clip, or one of clip_low and clip_high (clip is then that "
                          "side's)")


# --- rewards ----------------------------------------------------------------------------------

def _reward_span(site: Site, reward, key: str) -> Span:
    decl = next(i for i in site.items if isinstance(i, ast.RewardDecl)
                and i.name.value == reward.name)
    kw = decl.call.kwarg(key)
    return kw.span if kw is not None else decl.call.span


def overlong_reaches(site: Site, reward) -> SpecError | None:
    args = dict(reward.params)
    scorers = [s for s in site.stages if s.kind is OpKind.SCORE and s.target == reward.name]
    for s in scorers:
        gen = site.generator(site.responses_of(s) or "")
        longest = int((gen.arg("max_len") if gen is not None else None)
                      or site.workload.gen_len.max_len)
        conv = conversation(gen, longest) if gen is not None else None
        if conv is not None:            # a conversation's tokens after its prompt, all of them
            longest = conv.max_total_len
        top = int(args.get("max_len") or longest)
        band = int(args.get("buffer") or max(top // 4, 1))
        if band >= top:
            return SpecError(f"buffer must be below max_len ({top}), not {band}: the penalty "
                             "would start before the first token", _reward_span(
                                 site, reward, "buffer"), hint="a quarter of max_len is DAPO's")
        if top - band >= longest:
            return SpecError(f"overlong's penalty must be reachable: it starts at max_len - "
                             f"buffer = {top - band} tokens, and the responses '{s.name}' "
                             f"scores are at most {longest}", _reward_span(
                                 site, reward, "max_len" if "max_len" in args else "buffer"),
                             notes=[(f"'{s.name}' scores them here", s.span)],
                             hint=f"max_len = {longest} (the generate stage's"
                                  f"{' max_total_len' if conv is not None else ''}), or a "
                                  "longer buffer")
    return None


def takes_what_rpeg_passes(site: Site, reward) -> SpecError | None:
    from rpeg.spec.rewards import BadSignature, reward_signature
    decl = next(i for i in site.items if isinstance(i, ast.RewardDecl)
                and i.name.value == reward.name)
    where = decl.call.args[0].span if decl.call.args else decl.call.span
    try:
        reward_signature(reward.source, reward.module, reward.function, where)
    except BadSignature as e:
        return e
    return None


# --- optimizers -------------------------------------------------------------------------------

def warmup_within_run(site: Site, model) -> SpecError | None:
    warmup, steps = model.optimizer.warmup, site.workload.steps
    if warmup < steps:
        return None
    return SpecError(f"warmup must be shorter than the run's {steps} steps, not {warmup}: the "
                     f"learning rate would never reach lr", site.optimizer_span(model, "warmup"),
                     hint=f"warmup = {max(steps // 10, 1)} (a tenth of the run)")


def min_lr_below_lr(site: Site, model) -> SpecError | None:
    opt = model.optimizer
    if opt.schedule == "constant" or opt.min_lr < opt.lr:
        return None
    return SpecError(f"min_lr must be below lr ({opt.lr:g}), not {opt.min_lr:g}: a "
                     f"{opt.schedule} schedule decays from lr to min_lr",
                     site.optimizer_span(model, "min_lr"),
                     hint="min_lr = 0, or schedule = constant")


# --- the rules, as the registry attaches them ---------------------------------------------------

def _existing(check):
    """A check written against one stage's declaration, as a rule."""
    def rule(site: Site, stage):
        try:
            check(site, stage)
        except SpecError as e:
            return e
        return None
    return rule


def _refill_scores(site: Site, stage) -> None:
    from rpeg.spec.stages import _check_refill
    if stage.arg("refill_rounds"):
        _check_refill(stage, site.decl(stage.name), site.stages, site.targets)


def _weight_summed(site: Site, stage) -> None:
    from rpeg.spec.functions import function
    from rpeg.spec.stages import _key_span, _summed
    if stage.param("weight") is not None and stage.outputs[0] not in _summed(site.stages):
        raise SpecError(f"weight must weigh scores an estimator adds up, and no estimator "
                        f"adds up '{stage.outputs[0]}'",
                        _key_span(site.decl(stage.name).call, "weight",
                                  function(stage.function)),
                        hint=f"read {stage.outputs[0]} in an advantage estimator, or leave "
                             "weight out")


# every rule of the registry (rpeg.spec.preconditions) by name: the check it runs
CHECKS = {
    "refill_groups": group_samples,
    "refill_scores": _existing(_refill_scores),
    "greedy_groups": greedy_groups,
    "greedy_policy": greedy_policy,
    "top_p_greedy": top_p_greedy,
    "top_p_engine": top_p_engine,
    "untrained_head": untrained_head,
    "random_reference": random_reference,
    "one_vocabulary": one_vocabulary,
    "weight_summed": _existing(_weight_summed),
    "minibatches_fit": minibatches_fit,
    "own_samples": own_samples,
    "group_samples": group_samples,
    "greedy_baseline": greedy_baseline,
    "std_keywords": std_keywords,
    "k1_loss": k1_loss,
    "clip_shadowed": clip_shadowed,
    "overlong_reaches": overlong_reaches,
    "kv_fraction_engine": kv_fraction_engine,
    "reward_signature": takes_what_rpeg_passes,
    "warmup_within_run": warmup_within_run,
    "min_lr_below_lr": min_lr_below_lr,
}
