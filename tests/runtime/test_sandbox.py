"""The tool sandbox: every way a tool can misbehave is an error observation, the sandbox
keeps serving, and nothing outside a call's scratch directory changes.

The tools are real code in a module next to a spec folder; each call runs in the server's
forked, confined child (``rpeg.runtime.usercode.sandbox_server``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rpeg.errors import RuntimeFailure
from rpeg.runtime.usercode.sandbox import Sandbox
from rpeg.runtime.usercode.sandbox_server import landlock_abi
from rpeg.spec.tools import Tool

TOOLS = '''\
import ctypes
import os
import time


def calc(text):
    return str(eval(text, {"__builtins__": {}}))


def sleeps(text):
    time.sleep(30)
    return "late"


def allocates(text):
    return str(len(bytearray(2 * 1024 ** 3)))


def forks(text):
    while True:
        os.fork()


def forks_in_c(text):
    libc = ctypes.CDLL(None)
    born = 0
    for _ in range(200):
        pid = libc.fork()
        if pid == 0:
            time.sleep(120)
            libc._exit(0)
        born += pid > 0
    return str(born)


def writes(text):
    with open(text, "w") as f:
        f.write("written")
    return "wrote " + text


def writes_in_c(text):
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.open(text.encode(), os.O_WRONLY | os.O_CREAT, 0o644)
    if fd < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    libc.write(fd, b"written", 7)
    return "wrote " + text


def removes(text):
    os.remove(text)
    return "removed"


def prints(text):
    chunk = "x" * (1 << 20)
    for _ in range(100):
        print(chunk)
    return "printed"


def returns_much(text):
    return "y" * (1 << 24)


def raises(text):
    raise ValueError("no such key: " + text)


def not_text(text):
    return 42


def looks(text):
    return " ".join([str(sorted(os.environ)), os.getcwd(),
                     str(sorted(int(f) for f in os.listdir("/proc/self/fd")))])


class Counter:
    def reset(self, prompt, row):
        self.n = 0
        return "ready for " + prompt

    def step(self, action):
        self.n += 1
        if action == "crash":
            raise RuntimeError("the environment broke")
        if action == "hang":
            time.sleep(30)
        return f"{action} {self.n}", self.n >= 3
'''

NAMES = ("calc", "sleeps", "allocates", "forks", "forks_in_c", "writes", "writes_in_c",
         "removes", "prints", "returns_much", "raises", "not_text", "looks")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools")
    (d / "tools.py").write_text(TOOLS)
    (d / "keep.txt").write_text("kept")
    return d


@pytest.fixture(scope="module")
def box(folder):
    tools = [Tool(n, "tools", n, timeout=1.5, memory=256e6, max_output=65536) for n in NAMES]
    tools.append(Tool("counter", "tools", "Counter", environment=True, timeout=1.5))
    sandbox = Sandbox.start(tools, path=[str(folder)], slots=2)
    yield sandbox
    sandbox.close()


def snapshot(*folders: Path) -> dict[str, tuple[int, float]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime) for d in folders
            for p in d.rglob("*")}


def test_a_tool_answers(box):
    (out,) = box.call_many([("calc", "6*7")])
    assert (out.ok, out.text, out.error) == (True, "42", "")


@pytest.mark.parametrize("tool,why", [
    ("sleeps", "timed out after 1.5 s"),
    ("allocates", "MemoryError"),
    ("forks", "may not start processes"),
    ("prints", "output limit"),
    ("returns_much", "returned more than 65536 bytes"),
    ("raises", "ValueError: no such key: k1 (tools.py:"),
    ("not_text", "a tool (or an environment) must return text, not int"),
])
def test_a_misbehaving_tool_is_an_error_and_the_sandbox_goes_on(box, tool, why):
    (out,) = box.call_many([(tool, "k1")])
    assert not out.ok and why in out.error, out
    (after,) = box.call_many([("calc", "1+1")])
    assert after.text == "2"


def test_nothing_outside_the_scratch_directory_changes(box, folder, tmp_path):
    before = snapshot(folder, tmp_path)
    outside = [tmp_path / "outside.txt", folder / "keep.txt", folder / "new.txt"]
    tools = ["writes", "removes"] + (["writes_in_c"] if landlock_abi() or os.geteuid() == 0
                                     else [])
    calls = [(t, str(p)) for t in tools for p in outside]
    calls += [("writes", "../escape.txt"), ("writes", "inside.txt")]
    out = box.call_many(calls)
    assert [o.ok for o in out] == [False] * (len(calls) - 1) + [True], out
    assert snapshot(folder, tmp_path) == before
    assert not (tmp_path / "outside.txt").exists() and (folder / "keep.txt").read_text() == "kept"


def test_a_fork_bomb_in_c_is_bounded_and_leaves_nothing(box):
    (out,) = box.call_many([("forks_in_c", "")])
    assert out.ok and int(out.text) < 200          # the process limit refused most forks
    # the children it started were killed: none is left under this box's server (another
    # test's server, in another test process, may have calls of its own running)
    server, deadline = box.proc.pid, time.monotonic() + 30.0
    while (mine := [p for p in os.listdir("/proc")
                    if p.isdigit() and _parent(int(p)) == server]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mine == []


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        return int(stat[stat.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError):
        return -1


def test_a_call_sees_a_cleared_environment_its_own_folder_and_no_descriptors(box):
    (out,) = box.call_many([("looks", "")])
    env, cwd, fds = out.text.split(" ", 2)
    assert env == "[]" and Path(cwd).name.startswith("call-")
    assert fds == "[0, 1, 2, 3, 4]"               # stdin, output, output, answer, listdir's


def test_calls_run_concurrently_up_to_the_slots(box):
    import threading
    out, most = [], 0
    calls = threading.Thread(target=lambda: out.extend(box.call_many([("sleeps", "")] * 3)))
    calls.start()
    while calls.is_alive():             # the server's children: one per call running
        most = max(most, len([p for p in os.listdir("/proc") if p.isdigit()
                              and _parent(int(p)) == box.proc.pid]))
        time.sleep(0.02)
    calls.join()
    assert [o.timed_out for o in out] == [True, True, True]
    assert most == 2                    # two slots: two side by side, never three


def test_an_environment_keeps_state_across_steps(box):
    opened = box.open_many([("counter", "p1", {"a": 1}), ("counter", "p2", {})])
    assert [o.text for o in opened] == ["ready for p1", "ready for p2"]
    handles = [o.handle for o in opened]
    first = box.step_many([(h, "go") for h in handles])
    assert [(o.text, o.done) for o in first] == [("go 1", False)] * 2
    crash, hang = box.step_many([(handles[0], "crash"), (handles[1], "hang")])
    assert not crash.ok and "the environment broke" in crash.error and crash.done
    assert not hang.ok and hang.timed_out and hang.done
    late = box.step_many([(h, "go") for h in handles])
    assert all(not o.ok and o.done for o in late)      # both ended
    box.close_many(handles)


def test_a_tool_that_cannot_load_stops_the_start(folder):
    bad = Tool("missing", "tools", "no_such_function", timeout=1.0)
    with pytest.raises(RuntimeFailure, match="tool 'missing' .* must load in the sandbox"):
        Sandbox.start([bad], path=[str(folder)], slots=1)


def test_a_dead_server_fails_the_calls_in_flight_and_restarts(folder):
    box = Sandbox.start([Tool("calc", "tools", "calc", timeout=1.0)], path=[str(folder)])
    try:
        box.proc.kill()
        box.proc.wait()
        (out,) = box.call_many([("calc", "2*3")])
        assert out.text == "6"                    # a new server answered
    finally:
        box.close()


def test_a_tool_module_that_prints_as_it_is_imported_starts_and_answers(tmp_path):
    """The server imports the tools' modules in its own process: what a module prints then
    (a line, or more than a pipe holds, unflushed) goes to its log, not into its answers
    (the client read the text as a message's length and waited forever)."""
    (tmp_path / "loud.py").write_text(
        "print('loading loud ...', flush=True)\n"
        "print('x' * (1 << 17))\n"
        "def echo(text):\n    return 'echo:' + text\n")
    box = Sandbox.start([Tool("echo", "loud", "echo", timeout=2.0)], path=[str(tmp_path)])
    try:
        (out,) = box.call_many([("echo", "hi")])
        assert out.ok and out.text == "echo:hi"
    finally:
        box.close()


def test_max_output_counts_the_texts_utf8_bytes(tmp_path):
    """max_output = 1000 bytes: 1,000 ASCII characters pass and 1,001 do not; 500 é (1,000
    bytes) pass and 501 do not (the JSON escape of the answer was measured, with 1 KB
    slack: 1,900 ASCII passed and 800 bytes of é did not)."""
    (tmp_path / "sized.py").write_text(
        "def sized(text):\n    ch, n = text.split()\n    return ch * int(n)\n")
    box = Sandbox.start([Tool("sized", "sized", "sized", timeout=2.0, max_output=1000)],
                        path=[str(tmp_path)])
    try:
        got = box.call_many([("sized", "a 1000"), ("sized", "a 1001"), ("sized", "é 500"),
                             ("sized", "é 501")])
        assert [o.ok for o in got] == [True, False, True, False], got
        assert "more than 1000 bytes" in got[1].error
    finally:
        box.close()


def test_an_environments_done_must_be_a_truth_value():
    """(obs, "false") is not done: a string is no truth value, and bool() reads it as true;
    the step is refused (an error observation, the sample ended) instead of ending quietly."""
    from rpeg.runtime.usercode.sandbox_server import _step_value
    assert _step_value(("seen", False)) == ("seen", False)
    assert _step_value(("seen", 1)) == ("seen", True)
    assert _step_value("seen") == ("seen", False)
    with pytest.raises(TypeError, match="done a bool, not str"):
        _step_value(("seen", "false"))
