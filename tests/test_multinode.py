"""
Several nodes, on one machine: two torchrun agents (--nnodes=2 --nproc_per_node=1, --node_rank=0
and 1) meet at a c10d rendezvous on loopback, as docs/recipes.md's multi-node command has them meet on
real nodes, and train.py runs two GRPO steps, checkpoints, and resumes to a third. The c10d
rendezvous hands out the ranks in its own order (torchrun ignores --node_rank there, and says so):
either node may be rank 0, and nothing here assumes which.

What differs from one node with two ranks: each worker is LOCAL_RANK 0 of its node, so a RANK-0
duty (the config, the metrics, the checkpoint's marker, the export) must go by RANK; the ranks
write one checkpoint folder together, which is why run_dir sits on a filesystem every node shares
(here: the same folder); and each node has its own model cache (~/.cache/nanoagent on its own
disk: here NANOAGENT_CACHE differs), so every node builds the tiny model itself, before the
process group, and the two builds must agree byte for byte (the weights come from rank 0, but each
node's engine and tokenizer read its own copy).
"""

import filecmp
import json
import os
import subprocess
import sys
import time

import pytest
from torch.distributed import TCPStore

import procs
from test_train import QUICK, ROOT

pytestmark = pytest.mark.slow
ALTERNATING = os.path.join(ROOT, "tests", "alternating_task.py")  # every group's rewards vary: each step updates the policy


def two_nodes(tmp_path, name, *overrides, own_run_dir=False, timeout=900):
    """train.py under two torchrun agents, node 0 and node 1, each with its own model cache; returns
    their exit codes and outputs. One agent that fails ends the other (which would wait at the
    rendezvous). own_run_dir: each node runs in a folder of its own with run_dir=run, as the same
    path on each node's own disk would be. The rendezvous store is the test's, on a port it binds itself
    (port 0): both agents join it as clients (is_host=false), where on real nodes node 0's agent hosts it at
    a port the nodes are told; a port picked free here and bound later by node 0 could be taken between the
    two (EADDRINUSE, the race CI met in the one-node tests)."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    agents, logs = [], [tmp_path / f"{name}.node{node}.log" for node in range(2)]
    try:
        for node, log in enumerate(logs):
            cwd = tmp_path / f"node{node}" if own_run_dir else ROOT
            os.makedirs(cwd, exist_ok=True)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                   f"--node_rank={node}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{store.port}",
                   "--rdzv_conf=is_host=false", f"--rdzv_id={name}", os.path.join(ROOT, "train.py"), *QUICK,
                   f"run_dir={'run' if own_run_dir else tmp_path / 'run'}", *overrides]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "NANOAGENT_CACHE": str(tmp_path / f"cache{node}")}
            with open(log, "w") as f:
                agents.append(procs.start(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env))
        deadline = time.monotonic() + timeout
        while any(a.poll() is None for a in agents) and not any(a.poll() for a in agents) and time.monotonic() < deadline:
            time.sleep(1)
    finally:
        for agent in agents:  # the agent and its worker, which torchrun starts in a session of its own
            procs.end(agent)
    return [agent.returncode for agent in agents], [log.read_text() for log in logs]


def succeeded(codes, outputs):
    for node, (code, out) in enumerate(zip(codes, outputs)):
        assert code == 0, f"node {node} exited {code}:\n" + "\n".join(o[-3000:] for o in outputs)
    return outputs


def metrics(tmp_path):
    return [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]


def test_two_nodes_train_checkpoint_and_resume(tmp_path):
    overrides = ["algo=grpo", f"data.task={ALTERNATING}"]
    outputs = succeeded(*two_nodes(tmp_path, "first", *overrides, "steps=2"))
    # one rank 0 over both nodes: one node prints the run, the other nothing of it, and each step is logged once
    printing = [out for out in outputs if "step    2/2" in out]
    assert len(printing) == 1, f"{len(printing)} nodes print the run: rank 0's duties must go by RANK, not LOCAL_RANK"
    assert "exported" in printing[0] and printing[0].count("checkpoint: ") == 1
    first = metrics(tmp_path)
    assert [m["step"] for m in first] == [1, 2]
    for m in first:
        assert m["policy_updates"] == 2 and m["grad_norm"] > 0  # 4 prompts x 4 samples over 2 ranks, mini-batches of 8
        assert m["engine_logprob_diff"] <= 1e-4  # fp32: both nodes' engines sample with the trainer's weights
    # every node built the tiny model into its own cache, and the two are the same files
    [built0], [built1] = os.listdir(tmp_path / "cache0"), os.listdir(tmp_path / "cache1")
    folder0, folder1 = tmp_path / "cache0" / built0, tmp_path / "cache1" / built1
    assert built0 == built1 and sorted(os.listdir(folder0)) == sorted(os.listdir(folder1))
    assert all(filecmp.cmp(folder0 / f, folder1 / f, shallow=False) for f in os.listdir(folder0))
    # the checkpoint holds both ranks' state, written into the one shared run_dir
    step2 = tmp_path / "run" / "checkpoints" / "step_000002"
    assert json.load(open(step2 / "COMPLETE")) == {"step": 2, "world_size": 2}
    assert {"rank0.json", "rank1.json"} <= set(os.listdir(step2))

    outputs = succeeded(*two_nodes(tmp_path, "resumed", *overrides, "steps=3"))
    [printing] = [out for out in outputs if "step    3/3" in out]
    assert f"resumed from {step2} at step 2" in printing and "warm start" not in printing  # both ranks loaded step 2
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2, 3]
    [step3] = [m for m in metrics(tmp_path) if m["step"] == 3]
    assert step3["policy_updates"] == 2 and step3["engine_logprob_diff"] <= 1e-4
    assert json.load(open(tmp_path / "run" / "checkpoints" / "step_000003" / "COMPLETE")) == {"step": 3, "world_size": 2}


def test_a_run_dir_on_each_nodes_own_disk_is_refused(tmp_path):
    """The ranks write one checkpoint folder together, so run_dir is a folder every node shares. With
    the same path on each node's own disk, a run used to finish as if nothing were wrong, its
    checkpoint marked complete on rank 0's node without the other node's shards, and the resume
    hung: rank 0 loading that checkpoint, rank 1 finding none and warm-starting, each waiting in a
    collective the other never joins. The first checkpoint now refuses it, on every rank."""
    codes, outputs = two_nodes(tmp_path, "own", "steps=1", "train.warm_start_steps=0", own_run_dir=True)
    for code, out in zip(codes, outputs):
        assert code != 0 and "run_dir must be one folder that every node shares" in out, out[-3000:]
    assert not any((tmp_path / f"node{node}" / "run" / "checkpoints" / "step_000001").exists() for node in range(2))
