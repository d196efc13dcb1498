"""A reward's bad output stops the run at that step with an error naming the reward, the
step and what was wrong; its exception shows the user's own frames; nothing non-finite
reaches an update, a checkpoint or metrics.jsonl."""

from __future__ import annotations

import json
import math
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

from rpeg.cli import main
from rpeg.errors import RuntimeFailure, Span
from rpeg.runtime.rundir.directory import step_metrics
from rpeg.runtime.usercode.rewards import call_reward, check_scores
from rpeg.spec.model import Reward

ROOT = Path(__file__).resolve().parents[2]
REWARD = Reward("judge", "myrewards", "judge", Span("spec.rpeg", 18, 1))


@pytest.mark.parametrize("value, words", [
    ([0.5] * 3, "4 scores (one per response), not 3 (step 7)"),
    ([0.5] * 5, "4 scores (one per response), not 5 (step 7)"),
    (0.5, "a list of 4 numbers (one per response), not a float (step 7)"),
    (None, "a list of 4 numbers (one per response), not None (step 7)"),
    (np.zeros((2, 2)), "not an array of shape (2, 2) (step 7)"),
    ([0.5, "high", 0.5, 0.5], "a number for every response, not the string 'high' "
                              "(response 1 of the 4 it scored, step 7)"),
    ([0.5, 0.5, None, 0.5], "not None (response 2 of the 4 it scored, step 7)"),
    ([0.5, 0.5, 0.5, math.nan], "a finite number for every response, not nan "
                                "(response 3 of the 4 it scored, step 7)"),
    ([-math.inf, 0.5, 0.5, 0.5], "a finite number for every response, not -inf"),
    ([1e39, 0.5, 0.5, 0.5], "a number float32 holds for every response, not 1e+39"),
])
def test_a_bad_output_is_refused_naming_the_reward_the_step_and_the_problem(value, words):
    with pytest.raises(RuntimeFailure) as got:
        check_scores(value, 4, REWARD, step=7)
    assert got.value.message.startswith("reward 'judge' (myrewards:judge) must return ")
    assert words in got.value.message
    assert got.value.span == REWARD.span


@pytest.mark.parametrize("value", [[1, 0, 0.5, 2], (True, False, 1.0, 0.0),
                                   np.arange(4, dtype=np.float64), np.ones(4, np.int32)])
def test_numbers_of_any_kind_one_per_response_are_scores(value):
    scores = check_scores(value, 4, REWARD, step=0)
    assert scores.dtype == np.float32 and scores.shape == (4,)
    assert scores.tolist() == [float(x) for x in value]


def _inner(x):
    return 1 / x                                                     # line of the raise


def _user_reward(prompts, responses, answers):
    return [_inner(0) for _ in responses]


def test_an_exception_in_a_reward_shows_the_users_own_frames():
    with pytest.raises(RuntimeFailure) as got:
        call_reward(_user_reward, REWARD, 3, ["p"], ["r"], ["a"])
    e = got.value
    assert e.message == ("reward 'judge' (myrewards:judge) raised ZeroDivisionError at "
                         "step 3: division by zero")
    here = Path(__file__).read_text().splitlines()
    frames = [(Path(s.path).name, here[s.line - 1].strip()) for _, s in e.notes]
    assert frames[0] == ("test_rewards.py", "return [_inner(0) for _ in responses]")
    assert frames[-1] == ("test_rewards.py", "return 1 / x                                 "
                                             "                    # line of the raise")
    assert e.notes[-1][0] == "in _inner: ZeroDivisionError raised here"
    text = e.render()
    assert "test_rewards.py:" in text and "^" in text and "Traceback" not in text


def test_a_call_that_fails_before_the_reward_s_code_says_so():
    """verl's signature called as a batch reward: the TypeError is raised by the call, so no
    frame of the user's is shown, and the hint says what rpeg passes instead of pointing at
    a traceback that is not there."""
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return 0.0
    with pytest.raises(RuntimeFailure) as got:
        call_reward(compute_score, REWARD, 0, ["p"], ["r"], ["a"], {"data_source": ["x"]})
    e = got.value
    assert "raised TypeError at step 0" in e.message and not e.notes
    assert e.hint.startswith("the reward could not be called with what rpeg passes")
    assert "above" not in e.hint


def test_a_reward_that_calls_sys_exit_fails_as_a_reward_not_as_a_lost_worker():
    import sys

    def quits(prompts, responses, answers):
        sys.exit(3)
    with pytest.raises(RuntimeFailure) as got:
        call_reward(quits, REWARD, 2, ["p"], ["r"], ["a"])
    assert got.value.message == "reward 'judge' (myrewards:judge) raised SystemExit at step 2: 3"


def test_a_column_named_as_a_list_rpeg_passes_is_not_passed_twice(tmp_path):
    """SQuAD's "answers" column beside the reward's own answers argument: passed once, as
    rpeg's answers (the call would otherwise raise TypeError: multiple values)."""
    from backends.torch_backend.rewards import Texts, python
    (tmp_path / "clash_reward.py").write_text(
        "def score(prompts, responses, answers, **columns):\n"
        "    assert 'answers' not in columns and columns['level'] == [1]\n"
        "    return [float(a == 'x') for a in answers]\n")
    import attrs
    reward = attrs.evolve(REWARD, module="clash_reward", function="score", kind="python",
                          source=str(tmp_path / "clash_reward.py"), folder=str(tmp_path))
    texts = Texts(("p",), ("r",), ("x",), (1,), 4, ({"answers": ["y"], "level": 1},), 0)
    scores, failed = python(reward, texts)
    assert scores.tolist() == [1.0] and failed == 0


def test_on_error_zero_scores_failures_0_and_counts_them():
    import attrs
    zero = attrs.evolve(REWARD, params=(("on_error", "zero"),))
    scores, failed = call_reward(_user_reward, zero, 3, ["p"] * 2, ["r"] * 2, ["a"] * 2)
    assert scores.tolist() == [0.0, 0.0] and failed == 2
    scores, failed = call_reward(lambda p, r, a: [1.0, math.nan], zero, 3, ["p"] * 2,
                                 ["r"] * 2, ["a"] * 2)
    assert scores.tolist() == [1.0, 0.0] and failed == 1
    with pytest.raises(RuntimeFailure, match="4 scores"):      # a wrong count is a bug
        call_reward(lambda p, r, a: [1.0], zero, 3, ["p"] * 4, ["r"] * 4, ["a"] * 4)


def test_a_metrics_row_stays_strict_json_naming_what_was_not_finite():
    events = [{"kind": "train", "op": "actor_step", "rank": 0, "stats": {
        "policy_loss": math.nan, "entropy": 1.5, "grad_norm": math.inf}}]
    row = step_metrics(2, events, 0.5)
    assert row["nonfinite"] == ["grad_norm.actor_step", "policy_loss"]
    assert row["entropy"] == 1.5 and "policy_loss" not in row
    json.dumps(row, allow_nan=False)


# --- a real run --------------------------------------------------------------------------------

BAD = """
import math

CALLS = []


def judge(prompts, responses, answers=None):
    CALLS.append(len(responses))
    if len(CALLS) > {calls_ok}:               # from the third call on: step 1's, or step 0's
        {bad}
    return [0.5] * len(responses)


def helper(x):
    return 1 / x
"""


def _spec(tmp_path: Path, module: str, bad: str) -> Path:
    """tiny_ppo with a reward that goes bad from step 1 (a module of its own: a worker
    keeps a module it imported once)."""
    (tmp_path / "data").symlink_to(ROOT / "pipelines" / "data")
    # runtime-split: the score stage runs on one device, 2 chunks a step
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(BAD).format(calls_ok=2, bad=bad))
    text = (ROOT / "pipelines" / "tiny_ppo.rpeg").read_text()
    spec = tmp_path / "bad.rpeg"
    spec.write_text(text.replace('python("rewards:toy_reward")', f'python("{module}:judge")'))
    return spec


def _strict(path: Path) -> list[dict]:
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")
    return [json.loads(x, parse_constant=refuse) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def scheduler(local_cluster):
    with local_cluster(2) as address:
        yield address


def test_a_nan_score_stops_the_run_at_its_step_and_nothing_non_finite_is_kept(
        tmp_path, capsys, scheduler):
    spec, run_dir, err = _failed_run(tmp_path, capsys, scheduler, "nan_reward",
                                     "return [math.nan] * len(responses)")
    found = re.search(r"bad\.rpeg:18:1: error: reward 'toy' \(nan_reward:judge\) must return a "
                      r"finite number for every response, not nan \(response 0 of the 16 it "
                      r"scored, step (\d)\)", err)
    assert found, err
    failed = int(found.group(1))                    # the third call's step: 1, or 0 when its
    assert failed in (0, 1)                         # second chunk came after step 1's first
    rows = _strict(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(failed))
    # why it stopped is in the run's record, for show and its JSON, not on stderr alone
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "failed" and meta["error"].startswith(
        f"{spec}:18:1: reward 'toy' (nan_reward:judge) must return a finite number"), meta
    assert main(["show", str(run_dir), "--no-verify"]) == 0
    assert f"stopped by: {meta['error']}" in capsys.readouterr().out
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    _finite_checkpoints(run_dir)


def _failed_run(tmp_path, capsys, scheduler, module: str, bad: str):
    """(spec, run dir, stderr) of tiny_ppo whose reward goes ``bad`` from step 1, run to
    its failure, a checkpoint a step."""
    spec = _spec(tmp_path, module, bad)
    run_dir = tmp_path / "run"
    assert main(["run", str(spec), "--steps", "4", "--strategy", "runtime-split",
                 "--scheduler", scheduler, "--no-progress", "--run-dir", str(run_dir),
                 "--checkpoint-every", "1"]) == 1
    return spec, run_dir, capsys.readouterr().err


def _finite_checkpoints(run_dir) -> None:
    from safetensors.numpy import load_file
    for f in (run_dir / "checkpoints").rglob("*.safetensors"):
        for name, value in load_file(f).items():
            assert np.isfinite(value.astype(np.float64)).all(), (f, name)


@pytest.mark.slow          # a real run; the rule has a unit test (tests/backends/test_torch_backend.py)
def test_a_non_finite_gradient_stops_the_run_before_its_update(tmp_path, capsys, scheduler):
    # scores float32 holds (so the reward passes), whose squared value error does not
    _, run_dir, err = _failed_run(tmp_path, capsys, scheduler, "huge_reward",
                                  "return [3e38] * len(responses)")
    assert re.search(r"bad\.rpeg:\d+:1: error: train stage '\w+' at step [01]: the gradient "
                     r"norm is (inf|nan) \(loss (inf|nan)\), so the update was not applied",
                     err), err
    assert "Traceback" not in err
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "failed" and "the gradient norm is" in meta["error"]
    _finite_checkpoints(run_dir)


@pytest.mark.slow          # a second real run; the traceback rule has a unit test above
def test_an_exception_in_a_reward_shows_the_users_file_and_line(tmp_path, capsys, scheduler):
    spec = _spec(tmp_path, "raising_reward", "return [helper(0) for _ in responses]")
    assert main(["run", str(spec), "--steps", "4", "--strategy", "runtime-split",
                 "--scheduler", scheduler, "--no-progress",
                 "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert re.search(r"error: reward 'toy' \(raising_reward:judge\) raised ZeroDivisionError "
                     r"at step [01]: division by zero", err), err
    rewards = str(tmp_path / "raising_reward.py")
    assert f"{rewards}:10:" in err and f"{rewards}:15:12: note: in helper: " \
           "ZeroDivisionError raised here" in err
    assert "return 1 / x" in err and "Traceback" not in err
