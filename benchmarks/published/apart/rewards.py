"""The rule-based reward these rows' specs name (a verifier's exact match), for the checker to
find; the calibration prices the rows and never runs it."""


def exact_match(prompts, responses, answers=None):
    answers = answers or [""] * len(responses)
    return [float(r.strip() == a.strip()) for r, a in zip(responses, answers, strict=True)]
