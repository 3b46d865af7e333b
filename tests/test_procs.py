"""
tests/procs.py: the process trees the tests start end with the test, whatever ends it. The tree is
one that hides from the usual ways of killing it: a child with a grandchild in its process group, one
in a session of its own (as torchrun starts its workers), and one whose parent exited (re-parented
out of the tree). It must be gone after a subprocess timeout, after a test that fails, and after
the pytest running the test is stopped by Ctrl-C, SIGTERM or SIGKILL.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

import procs

TESTS = os.path.dirname(os.path.abspath(__file__))
# The tree: writes its pids (its own first) to argv[1] once all of them run, then waits
TREE = """
import os, subprocess, sys
quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
same = subprocess.Popen(["sleep", "600"], **quiet)
own = subprocess.Popen(["sleep", "600"], start_new_session=True, **quiet)
spawn = "import subprocess, sys; print(subprocess.Popen(sys.argv[1:], start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"
orphan = int(subprocess.run([sys.executable, "-c", spawn, "sleep", "600"], capture_output=True, text=True, check=True).stdout)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(" ".join(map(str, [os.getpid(), same.pid, own.pid, orphan])))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
own.wait()
"""
# Run by an inner pytest (with the suite's conftest.py): trees through procs.start and procs.run, and a test that fails
INNER = f"""
import os, sys, time
import procs
from test_procs import alive

TREE, DIR = {TREE!r}, os.environ["TREES"]


def started_tree(name):
    procs.start([sys.executable, "-c", TREE, os.path.join(DIR, name)])
    while not os.path.exists(os.path.join(DIR, name)):
        time.sleep(0.05)


def test_fails_with_a_tree_running():
    started_tree("failed")
    assert False, "this test fails"


def test_the_failed_tests_tree_is_gone():
    assert not [pid for pid in map(int, open(os.path.join(DIR, "failed")).read().split()) if alive(pid)]


def test_waits_with_two_trees_running():
    started_tree("started")
    procs.run([sys.executable, "-c", TREE, os.path.join(DIR, "ran")], timeout=600)
"""


def alive(pid):
    """Whether pid runs (a zombie does not: it only waits for its parent to collect its exit status)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def left_running(pids, within):
    """The pids still running `within` seconds from now (fewer, as soon as none is); those that are
    then SIGKILLed, so that a failing test leaves nothing behind either."""
    end = time.time() + within
    while (running := [pid for pid in pids if alive(pid)]) and time.time() < end:
        time.sleep(0.1)
    for pid in running:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if procs.TAG.encode() in f.read():  # still one of ours, not a new process under a reused pid
                os.kill(pid, signal.SIGKILL)
    return running


def read_pids(path):
    return [int(p) for p in open(path).read().split()]


def test_a_timeout_ends_the_whole_tree(tmp_path):
    # the tree must be whole when the timeout expires: a machine too loaded for that gets a longer timeout
    for timeout in (5, 20, 80, 320):
        with pytest.raises(subprocess.TimeoutExpired):
            procs.run([sys.executable, "-c", TREE, str(tmp_path / f"pids{timeout}")], timeout=timeout)
        if (tmp_path / f"pids{timeout}").exists():
            break
    pids = read_pids(tmp_path / f"pids{timeout}")
    assert len(pids) == 4 and left_running(pids, 0) == []


@pytest.fixture
def inner_pytest(tmp_path):
    """A function that starts a pytest of INNER's given tests, with the suite's conftest.py as a
    plugin and its output in tmp_path/log; and the folder where the trees write their pids. The
    inner pytest starts with SIGINT at its default, as from a terminal, so Python turns it into
    KeyboardInterrupt: this suite may itself run with SIGINT ignored (CI, a script's background
    job), and a child inherits that."""
    (tmp_path / "test_inner.py").write_text(INNER)
    trees = tmp_path / "trees"
    trees.mkdir()
    with open(tmp_path / "log", "w") as log:
        def start(*tests):
            return procs.start([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                                *[f"test_inner.py::{t}" for t in tests]], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONPATH": TESTS, "TREES": str(trees)},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        yield start, trees


def test_a_failing_test_ends_its_tree(inner_pytest, tmp_path):
    start, trees = inner_pytest
    pytest_run = start("test_fails_with_a_tree_running", "test_the_failed_tests_tree_is_gone")
    assert pytest_run.wait(timeout=600) == 1
    log = (tmp_path / "log").read_text()
    assert "1 failed, 1 passed" in log, log[-3000:]
    assert left_running(read_pids(trees / "failed"), 0) == []


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "sigterm", "sigkill"])
def test_a_stopped_pytest_ends_its_trees(stop, inner_pytest, tmp_path):
    start, trees = inner_pytest
    pytest_run, deadline = start("test_waits_with_two_trees_running"), time.time() + 600
    while not ((trees / "started").exists() and (trees / "ran").exists()):
        assert pytest_run.poll() is None and time.time() < deadline, (tmp_path / "log").read_text()[-3000:]
        time.sleep(0.1)
    pids = read_pids(trees / "started") + read_pids(trees / "ran")
    assert all(alive(pid) for pid in pids)
    pytest_run.send_signal(stop)
    assert pytest_run.wait(timeout=120) != 0
    # Ctrl-C: pytest ends them as it tears down; SIGTERM, SIGKILL: its sentinel, as soon as pytest is gone
    assert left_running(pids, 60) == [], (tmp_path / "log").read_text()[-3000:]
