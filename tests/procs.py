"""
Child processes of the tests, and their whole trees, end with the test that started them: after a
failure, a subprocess timeout, Ctrl-C, and also when pytest itself is killed (SIGTERM, SIGKILL, a
timeout around it). Without this, a learning test's torchrun was seen still training 12 minutes
after pytest was killed.

The tree of a child is found by a tag in its environment (NANOAGENT_TEST_PROCESS=<this pytest's
id>.<n>), which every descendant inherits wherever it ends up: torchrun starts each worker in a
session of its own (so killing the child's process group misses them), and a worker whose torchrun
died is re-parented away from the tree (so walking the parent links misses it). Linux's
PR_SET_PDEATHSIG would not do either: it reaches only the direct child, not its children, and it
fires when the thread that started the child ends. So:
  - run / start give each child its tag (after the tag it inherited, if a test's child is itself a
    pytest) and a session of its own (what Ctrl-C in the terminal sends then goes to pytest alone,
    which ends the trees itself);
  - end SIGKILLs the child's session and every process with its tag, until none is left;
  - conftest.py ends every process a test started when the test ends, whatever ended it;
  - a sentinel process, started with the first child, waits for this pytest to exit (the end of
    its stdin, a pipe only pytest holds, however pytest ends) and then SIGKILLs every process with
    this pytest's tags. It runs in a session of its own, so Ctrl-C does not stop it first.
"""

import itertools
import os
import signal
import socket
import subprocess
import sys
import time

TAG = "NANOAGENT_TEST_PROCESS"
RUN = f"{os.getpid()}-{os.urandom(4).hex()}"  # this pytest's id: the tag of each child it starts is RUN.<n>
counter = itertools.count()
started = []  # the Popen of every child started and not yet ended
sentinel = None  # the sentinel's Popen: its stdin is the pipe whose end tells it that pytest is gone


def tagged():
    """{pid: tag} of every process (of ours) that carries a tag in its environment; a process that
    exited (a zombie included: its environment reads as empty) is not there."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        for entry in environ:
            if entry.startswith(TAG.encode() + b"="):
                found[int(name)] = entry[len(TAG) + 1:].decode(errors="replace")
    return found


def sweep(match):
    """SIGKILL every process whose tags (those of the children it descends from) `match`, again
    until none is left (one may fork while it is killed); returns their pids."""
    killed = set()
    while pids := [pid for pid, tag in tagged().items() if match(tag.split()) and pid != os.getpid()]:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed.update(pids)
        time.sleep(0.01)
    return killed


def start(cmd, **kwargs):
    """subprocess.Popen(cmd, **kwargs) with the child tagged and in a session of its own; it and
    its tree end with the test (conftest.py), or earlier with end."""
    global sentinel
    if sentinel is None:  # in a session of its own and untagged: neither Ctrl-C nor a sweep stops it
        sentinel = subprocess.Popen([sys.executable, os.path.abspath(__file__), RUN], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)  # no pipe of pytest's output held open
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    env[TAG] = f"{env.get(TAG, '')} {RUN}.{next(counter)}".lstrip()
    proc = subprocess.Popen(cmd, **{**kwargs, "env": env, "start_new_session": True})
    proc.tag = env[TAG].split()[-1]
    started.append(proc)
    return proc


def end(proc):
    """SIGKILL the tree of a child that start began (its session, and every process with its tag:
    those that left the session), then reap the child. A tree that is gone is left alone."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the child is not reaped yet, so its session id is still its own
    sweep(lambda tags: proc.tag in tags)
    proc.wait()
    if proc in started:
        started.remove(proc)


def end_all():
    """End every child that start began and that was not ended yet."""
    for proc in list(started):
        end(proc)


def run(cmd, timeout, capture_output=False, **kwargs):
    """subprocess.run for the tests: the child's whole tree is ended when the child returns (what
    it left running), when the timeout expires (TimeoutExpired then carries what the child wrote)
    and when anything else interrupts the wait (Ctrl-C)."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc = start(cmd, **kwargs)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        end(proc)
        e.stdout, e.stderr = proc.communicate()
        raise
    finally:
        end(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


if __name__ == "__main__":  # the sentinel of the pytest whose id is argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdin.buffer.read()  # returns once pytest has exited, however it ended
    sweep(lambda tags: any(tag.startswith(sys.argv[1] + ".") for tag in tags))


def torchrun(nproc):
    """The command that starts nproc ranks of a script under torchrun on this machine. --standalone: the
    rendezvous store binds a port of the kernel's choosing itself and the ranks join that store. A port
    picked free beforehand (--master_port) is free only until it is closed again: on a busy machine
    another process's connection was given it before torchrun bound it (EADDRINUSE, seen in CI)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def free_port():
    """A free TCP port on loopback, free until closed (another process may be given it after): only for an
    address nothing listens on (a rank refused before its process group exists)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
