"""The stop flag: a stop-at-once a signal handler raised inside a finaliser (where Python
prints and drops it) is raised again at the run loop's next check."""

import gc
import os
import signal
import sys

import pytest

from rpeg.runtime.dask.stopflag import StopFlag, Terminated


class _Finalised:
    """An object whose finaliser runs Python code, as a Dask future's ``__del__`` does."""

    def __init__(self, stop_with) -> None:
        self.stop_with = stop_with

    def __del__(self) -> None:
        self.stop_with()


def test_sigterm_lost_in_a_finaliser_is_raised_at_the_next_check(tmp_path, monkeypatch):
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_value))
    (tmp_path / "checkpoints" / "step-000002").mkdir(parents=True)    # one to resume from
    (tmp_path / "checkpoints" / "step-000002" / "COMPLETE").write_text("")
    stop = StopFlag()
    stop.install_terminate(str(tmp_path))
    try:
        stop.check()                                 # nothing asked: no stop
        obj = _Finalised(lambda: stop._terminate(signal.SIGTERM, None))
        del obj                                      # the handler's raise lands in __del__
        gc.collect()
        assert [type(e) for e in dropped] == [Terminated]     # Python drops it
        with pytest.raises(Terminated, match="SIGTERM") as got:
            stop.check()
        assert f"rpeg run --resume {tmp_path}" in got.value.hint
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) is not stop._terminate


def test_a_real_sigterm_is_raised_and_then_kept(tmp_path):
    stop = StopFlag()
    stop.install_terminate(str(tmp_path))
    try:
        with pytest.raises(Terminated) as e:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0)               # a point where the handler runs
        with pytest.raises(Terminated):
            stop.check()
    finally:
        stop.uninstall()
    # nothing complete to resume from: the hint does not offer a resume
    assert "no checkpoint was complete yet" in e.value.hint
    (tmp_path / "checkpoints" / "step-000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-000004" / "COMPLETE").write_text("")
    stop = StopFlag()
    stop.install_terminate(str(tmp_path))
    try:
        with pytest.raises(Terminated) as e:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0)
    finally:
        stop.uninstall()
    assert f"rpeg run --resume {tmp_path}" in e.value.hint


def test_a_second_ctrl_c_is_kept_for_the_check_and_the_first_is_not():
    stop = StopFlag()
    stop._handle(signal.SIGINT, None)                 # once: stop at the next cut
    assert stop.requested
    stop.check()                                      # not a stop-at-once
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt):
        stop.check()
