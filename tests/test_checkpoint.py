"""
Checkpoints and the Hugging Face export under SIGKILL, and the export's tensor-by-tensor check;
what a resume may and may not take from a checkpoint.

A save replaces its folder atomically (write `.tmp`, move the old one to `.old`, rename, delete
`.old`), so whatever instant a kill lands on, a complete copy survives and the readers find it:
random kills of a process that loads and saves over and over (tests/save_driver.py), every leftover
a kill can leave, and a real trainer run killed while it writes a checkpoint, then resumed. A
checkpoint counts once its marker is there and it and config.json read (resume=auto says once what
it skipped, and why); a damaged one falls back to the previous one on every rank together; a
pickle in a checkpoint is refused, not run; keep_last prunes; a fresh start moves the old run
aside; a resume refuses a change of what the checkpoint is made of; metrics.jsonl holds each step
once.
"""

import json
import os
import queue
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

import procs
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from save_driver import advance, build, first_difference, full_state
from test_train import QUICK, ROOT, train
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoagent.checkpoint import (CheckpointError, check_resume, export_hf, latest_checkpoint,
                                  load_checkpoint, load_latest, resume_checkpoint, save_checkpoint,
                                  start_fresh, verify_export)
from nanoagent.common import MetricsLog
from nanoagent.config import ConfigError, from_dict, make_config, to_dict

DRIVER = os.path.join(ROOT, "tests", "save_driver.py")
CONFIG = to_dict(make_config("tiny"))


@pytest.fixture(scope="module")
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.slow
def test_saves_survive_kill_9_at_random_moments(tmp_path, tiny_model_dir):
    rng = random.Random(0)
    run_dir = tmp_path / "run"
    driver = procs.start([sys.executable, DRIVER, str(run_dir), tiny_model_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines, transcript = queue.Queue(), []

    def read():
        for line in driver.stdout:
            lines.put(line)
        lines.put("eof")
    threading.Thread(target=read, daemon=True).start()
    durations = {"load": [], "checkpoint": [], "export": []}
    completed = {"checkpoint": 0, "export": 0}  # the highest step whose save returned
    resumed, exports = [], {"hf": 0, "hf.old": 0, "none": 0}  # what the lives found

    def life(steps, kill=None):
        """One child of the driver; kill=(k, fraction): SIGKILL it `fraction` of the typical duration
        after its k-th load or save begins. Asserts on what it found left by the lives before. Returns its exit code."""
        driver.stdin.write(f"life {steps}\n")
        driver.stdin.flush()
        begun = 0
        while True:
            line = lines.get(timeout=120)
            transcript.append(line)
            assert line != "eof", "".join(transcript[-40:])
            word, *rest = line.split() or [""]
            if word == "pid":
                pid = int(rest[0])
            elif word == "resumed":  # a complete checkpoint, no older than the last save that returned, holding its exact state
                assert int(rest[0]) >= completed["checkpoint"], "".join(transcript[-40:])
                resumed.append(int(rest[0]))
            elif word == "export":  # loaded back: the last export that returned, or a later one
                assert (0 if rest[0] == "none" else int(rest[1])) >= completed["export"], "".join(transcript[-40:])
                exports[rest[0]] += 1
            elif word == "begin":
                if kill and begun == kill[0]:
                    time.sleep(kill[1] * statistics.median(durations[rest[0]]))
                    os.kill(pid, signal.SIGKILL)
                begun += 1
            elif word == "end":
                if rest[0] in completed:
                    completed[rest[0]] = max(completed[rest[0]], int(rest[1]))
                durations[rest[0]].append(float(rest[2]))
            elif word == "exit":
                return int(rest[0])

    try:
        t0 = time.perf_counter()
        assert life(2) == 0, "".join(transcript)  # not killed: typical durations, and a first export
        assert life(0) == 0, "".join(transcript)  # and of a load
        for _ in range(20):
            # during the load, the re-save of the step the life resumed from, its re-export, or the save of the next step
            code = life(3, kill=(rng.randrange(4), rng.random()))
            assert code == -signal.SIGKILL, "".join(transcript[-40:])
        assert life(1) == 0, "".join(transcript[-40:])  # checks what the 20th kill left
        elapsed = time.perf_counter() - t0
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
    assert sorted(os.listdir(run_dir)) == ["checkpoints", "hf"]
    assert all(re.fullmatch(r"step_\d{6}", name) for name in os.listdir(run_dir / "checkpoints"))
    print(f"20 kills in {elapsed:.0f}s; resumed from steps {resumed}; the export found in {exports}; median load "
          f"{statistics.median(durations['load']):.3f}s, save {statistics.median(durations['checkpoint']):.3f}s, "
          f"export {statistics.median(durations['export']):.3f}s")


def make_partial(source, target):
    """A copy of a complete checkpoint or export without its metadata or weights file: what a kill
    leaves while the copy is written (or deleted)."""
    shutil.copytree(source, target)
    os.remove(os.path.join(target, ".metadata" if os.path.exists(os.path.join(source, ".metadata")) else "model.safetensors"))


# What a kill leaves at each point of a save of step 2 (which already exists) and of the export
# (hf exists), and where the complete copy is then.
LEFTOVERS = {
    "writing a new step": ([("partial", "checkpoints/step_000002", "checkpoints/step_000003.tmp"), ("partial", "hf", "hf.tmp")],
                           "step_000002"),
    "writing over a step": ([("partial", "checkpoints/step_000002", "checkpoints/step_000002.tmp"), ("partial", "hf", "hf.tmp")],
                            "step_000002"),
    "between the two renames": ([("copy", "checkpoints/step_000002", "checkpoints/step_000002.tmp"),
                                 ("move", "checkpoints/step_000002", "checkpoints/step_000002.old"),
                                 ("copy", "hf", "hf.tmp"), ("move", "hf", "hf.old")], "step_000002.old"),
    "deleting the replaced copy": ([("partial", "checkpoints/step_000002", "checkpoints/step_000002.old"), ("partial", "hf", "hf.old")],
                                   "step_000002"),
}


@pytest.mark.parametrize("moment", LEFTOVERS)
def test_readers_cope_with_what_a_kill_leaves(moment, tmp_path, tiny_model_dir, world_of_one):
    model, optimizer = build(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    run_dir = tmp_path / "run"
    models, optimizers = {"policy": model}, {"policy": optimizer}
    for step in (1, 2):
        advance(model, optimizer, step)
        save_checkpoint(str(run_dir), step, models, optimizers, {"step": step}, CONFIG)
        export_hf(model, tokenizer, str(run_dir / "hf"), torch.bfloat16)
    step2 = full_state(model, optimizer)
    advance(model, optimizer, 3)  # moves on, so that the load below must bring step 2 back

    operations, complete = LEFTOVERS[moment]
    for operation, source, target in operations:
        {"partial": make_partial, "copy": shutil.copytree, "move": os.rename}[operation](run_dir / source, run_dir / target)
    path = latest_checkpoint(str(run_dir))
    assert path == str(run_dir / "checkpoints" / complete)
    assert load_checkpoint(path, models, optimizers) == (2, {"step": 2})
    resumed = full_state(model, optimizer)
    for name in step2["model"]:
        assert torch.equal(resumed["model"][name], step2["model"][name]), name
    assert resumed["optimizer"]["param_groups"] == step2["optimizer"]["param_groups"]

    # the next save and export put back what was moved aside and delete what is partial
    advance(model, optimizer, 3)
    save_checkpoint(str(run_dir), 3, models, optimizers, {"step": 3}, CONFIG)
    export_hf(model, tokenizer, str(run_dir / "hf"), torch.bfloat16)
    assert sorted(os.listdir(run_dir)) == ["checkpoints", "hf"]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step_000001", "step_000002", "step_000003"]
    assert load_checkpoint(str(run_dir / "checkpoints" / "step_000002"), models, optimizers) == (2, {"step": 2})


def test_export_is_in_the_training_dtype_and_checked_tensor_by_tensor(tmp_path, tiny_model_dir, world_of_one):
    model, _ = build(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    name = "model.layers.1.mlp.down_proj.weight"
    assert not torch.equal(full[name].to(torch.bfloat16).float(), full[name])  # the tiny model's weights are not bf16 numbers
    for dtype in (torch.float32, torch.bfloat16):
        out = tmp_path / str(dtype).removeprefix("torch.")
        export_hf(model, tokenizer, str(out), dtype)  # a correct export passes the check
        stored = load_file(out / "model.safetensors")
        assert all(tensor.dtype == dtype for tensor in stored.values())
        assert torch.equal(stored[name], full[name].to(dtype))
        assert AutoModelForCausalLM.from_pretrained(out).dtype == dtype  # the config says so too

    # one element of one tensor one ulp off
    folder = str(tmp_path / "bfloat16")
    stored = {k: v.clone() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    stored[name].view(torch.int16)[3, 5] += 1
    save_file(stored, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=rf"export in {re.escape(folder)} .*{re.escape(name)} differs \(1 of"):
        verify_export(full, folder, torch.bfloat16)


def start_train(run_dir, *overrides):
    """train.py under torchrun in the background, output in run_dir.log."""
    cmd = [*procs.torchrun(1), os.path.join(ROOT, "train.py"), *QUICK, f"run_dir={run_dir}", *overrides]
    with open(f"{run_dir}.log", "w") as log:
        return procs.start(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def kill_9(torchrun):
    """SIGKILL the trainer and torchrun. torchrun starts each worker in a session of its own, so
    killing torchrun's process group would leave the trainer running."""
    with open(f"/proc/{torchrun.pid}/task/{torchrun.pid}/children") as f:
        workers = [int(pid) for pid in f.read().split()]
    for worker in workers:
        os.killpg(worker, signal.SIGKILL)
    torchrun.kill()
    torchrun.wait()
    return workers


@pytest.mark.slow
def test_trainer_killed_while_saving_resumes_exactly(tmp_path):
    keys = ["reward", "pg_loss", "vf_loss", "grad_norm", "vf_grad_norm", "response_tokens", "clipfrac", "entropy"]
    # the entropy bonus and the KL reward move the policy and the critic although the tiny model earns no reward yet
    overrides = ["algo=ppo", "steps=3", "train.save_every=1", "rollout.engine=hf", "train.entropy_coef=0.01", "train.kl_mode=reward"]
    straight = start_train(tmp_path / "straight", *overrides)
    killed = start_train(tmp_path / "killed", *overrides)
    while not (tmp_path / "killed" / "checkpoints" / "step_000002.tmp").exists():
        assert killed.poll() is None, open(tmp_path / "killed.log").read()[-3000:]
        time.sleep(0.005)
    assert kill_9(killed)  # mid-save
    assert straight.wait(timeout=600) == 0, open(tmp_path / "straight.log").read()[-3000:]

    out, metrics = train(tmp_path / "killed", *overrides, nproc=1)
    resumed_at = int(re.search(r"resumed from \S+ at step (\d+)", out).group(1))
    assert resumed_at in (1, 2) and "warm start" not in out
    expected = [m for m in map(json.loads, open(tmp_path / "straight" / "metrics.jsonl")) if m["step"] == 3][0]
    [step3] = [m for m in metrics if m["step"] == 3]
    for k in keys:
        assert step3[k] == pytest.approx(expected[k], rel=1e-5, abs=1e-7), k
    assert sorted(os.listdir(tmp_path / "killed" / "checkpoints")) == ["step_000002", "step_000003"]  # train.keep_last=2
    assert [m["step"] for m in metrics] == [1, 2, 3]  # the step logged before the kill, once


def save_steps(run_dir, model, optimizer, steps, keep_last=0):
    """Advance to each step and save it; returns the full state of each step."""
    states = {}
    for step in steps:
        advance(model, optimizer, step)
        save_checkpoint(str(run_dir), step, {"policy": model}, {"policy": optimizer}, {"step": step}, CONFIG, keep_last)
        states[step] = full_state(model, optimizer)
    return states


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


# What can damage the newest complete checkpoint, and the reason load_latest gives for falling back
DAMAGE = {
    "rank file cut short": (lambda folder: truncate(folder / "rank0.json"), "JSONDecodeError"),
    "shard cut short": (lambda folder: truncate(next(folder.glob("*.distcp"))), "RuntimeError: PytorchStreamReader failed"),
    "metadata missing": (lambda folder: os.remove(folder / ".metadata"), "No such file"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(damage, tmp_path, tiny_model_dir, world_of_one, capsys):
    model, optimizer = build(tiny_model_dir)
    run_dir = tmp_path / "run"
    states = save_steps(run_dir, model, optimizer, [1, 2])
    apply, reason = DAMAGE[damage]
    apply(run_dir / "checkpoints" / "step_000002")
    advance(model, optimizer, 3)
    assert load_latest(str(run_dir), {"policy": model}, {"policy": optimizer}) == (str(run_dir / "checkpoints" / "step_000001"), 1, {"step": 1})
    assert first_difference(full_state(model, optimizer), states[1]) is None
    out = capsys.readouterr().out
    assert re.search(rf"step_000002 does not load: rank 0: .*{reason}.*; falling back to the previous complete checkpoint, .*step_000001\n", out), out
    # and when none loads, the run stops rather than start over from scratch
    apply(run_dir / "checkpoints" / "step_000001")
    with pytest.raises(CheckpointError, match="no complete checkpoint in .* loads: .*step_000002.*step_000001"):
        load_latest(str(run_dir), {"policy": model}, {"policy": optimizer})


# What can make the newest checkpoint's marker or config.json unreadable, and the reason resume=auto gives for not using it
UNREADABLE = {
    "marker cut short": (lambda folder: (folder / "COMPLETE").write_text('{"step": 2, "wor'), r"it does not read \(JSONDecodeError: "),
    "marker not an object": (lambda folder: (folder / "COMPLETE").write_text("[2, 1]"),
                             r"its COMPLETE marker is '\[2, 1\]', not \{'step': 2, 'world_size': <ranks>\}"),
    "marker of another step": (lambda folder: (folder / "COMPLETE").write_text('{"step": 7, "world_size": 1}'),
                               r"its COMPLETE marker is \"\{'step': 7, 'world_size': 1\}\", not \{'step': 2, "),
    "config cut short": (lambda folder: truncate(folder / "config.json"), r"it does not read \(JSONDecodeError: "),
    "config missing": (lambda folder: os.remove(folder / "config.json"), r"it does not read \(FileNotFoundError: .*config\.json"),
}


@pytest.mark.parametrize("damage", UNREADABLE)
def test_resume_skips_a_checkpoint_whose_marker_or_config_does_not_read(damage, tmp_path, tiny_model_dir, world_of_one, capsys):
    """resume=auto (what train.py calls before check_resume) takes the newest checkpoint whose marker and
    config.json read as save_checkpoint wrote them, and says once what it found and does not use: that
    one, a step folder without a marker (a save cut short, or an older nanoagent's), a partial save."""
    model, optimizer = build(tiny_model_dir)
    run_dir = tmp_path / "run"
    states = save_steps(run_dir, model, optimizer, [1, 2])
    checkpoints = run_dir / "checkpoints"
    apply, reason = UNREADABLE[damage]
    apply(checkpoints / "step_000002")
    shutil.copytree(checkpoints / "step_000001", checkpoints / "step_000003")
    os.remove(checkpoints / "step_000003" / "COMPLETE")
    shutil.copytree(checkpoints / "step_000001", checkpoints / "step_000004.tmp")
    capsys.readouterr()
    path = resume_checkpoint(str(run_dir))
    assert path == str(checkpoints / "step_000001")
    out = capsys.readouterr().out
    said = [rf"resume=auto: not using {re.escape(str(checkpoints / 'step_000002'))}: {reason}.*",
            rf"resume=auto: not using {re.escape(str(checkpoints / 'step_000003'))}: it has no COMPLETE marker \(a save that did not "
            r"finish, or a checkpoint of an older nanoagent\)",
            rf"resume=auto: not using {re.escape(str(checkpoints / 'step_000004.tmp'))}: a save or a deletion that did not finish .*"]
    lines = out.splitlines()
    assert len(lines) == 3 and all(re.fullmatch(pattern, line) for pattern, line in zip(said, lines)), out
    assert check_resume(path, make_config("tiny")) == []
    advance(model, optimizer, 3)
    assert load_latest(str(run_dir), {"policy": model}, {"policy": optimizer}) == (path, 1, {"step": 1})
    assert first_difference(full_state(model, optimizer), states[1]) is None
    # the next save at step 2 replaces the damaged one and deletes the partial one
    save_steps(run_dir, model, optimizer, [2])
    assert latest_checkpoint(str(run_dir)) == str(checkpoints / "step_000002")
    assert sorted(os.listdir(checkpoints)) == ["step_000001", "step_000002", "step_000003"]


@pytest.mark.slow
def test_trainer_resumes_past_an_unreadable_checkpoint_and_says_so_once(tmp_path):
    """train.py on 2 ranks, resumed where the newest checkpoint's marker is cut short and a step
    folder has no marker (an older nanoagent's): it goes on from the checkpoint before them (it
    stopped with a JSONDecodeError), and rank 0 alone says what it did not use and why."""
    run_dir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    overrides = ["rollout.engine=hf", "train.warm_start_steps=0", "train.save_every=1", "train.keep_last=0"]
    train(run_dir, *overrides, "steps=2")
    (checkpoints / "step_000002" / "COMPLETE").write_text('{"step": 2, "wor')
    shutil.copytree(checkpoints / "step_000001", checkpoints / "step_000003")
    os.remove(checkpoints / "step_000003" / "COMPLETE")
    out, metrics = train(run_dir, *overrides, "steps=3")
    unused = re.findall(r"resume=auto: not using (\S+): (.*)", out)
    assert unused == [(str(checkpoints / "step_000002"), "it does not read (JSONDecodeError: Unterminated string starting at: line 1 column 13 (char 12))"),
                      (str(checkpoints / "step_000003"), "it has no COMPLETE marker (a save that did not finish, or a checkpoint of an older nanoagent)")], out
    assert f"resumed from {checkpoints / 'step_000001'} at step 1" in out
    assert [m["step"] for m in metrics if "reward" in m] == [1, 2, 3]
    assert json.load(open(checkpoints / "step_000003" / "COMPLETE"))["step"] == 3  # the old folder was replaced by a real save


@pytest.mark.slow
def test_ranks_fall_back_together(tmp_path, tiny_model_dir):
    cmd = [*procs.torchrun(2), os.path.join(ROOT, "tests", "load_fallback.py"),
           str(tmp_path / "run"), tiny_model_dir]
    proc = procs.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # the ranks share the pipe and may write into each other's lines, so each report is matched whole, not by line
    assert sorted(re.findall(r"rank \d resumed \d+ \{[^}]*\}", proc.stdout)) == ["rank 0 resumed 1 {'step': 1}", "rank 1 resumed 1 {'step': 1}"]
    assert "step_000002 does not load: rank 1: JSONDecodeError" in proc.stdout


def test_only_checkpoints_with_their_marker_count_and_keep_last_prunes(tmp_path, tiny_model_dir, world_of_one):
    model, optimizer = build(tiny_model_dir)
    run_dir = tmp_path / "run"
    save_steps(run_dir, model, optimizer, [1, 2, 3, 4], keep_last=2)
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step_000003", "step_000004"]
    marker = json.load(open(run_dir / "checkpoints" / "step_000004" / "COMPLETE"))
    assert marker == {"step": 4, "world_size": 1}
    # a folder without its marker (files not all on disk when the machine went down) is not a checkpoint
    os.remove(run_dir / "checkpoints" / "step_000004" / "COMPLETE")
    assert latest_checkpoint(str(run_dir)) == str(run_dir / "checkpoints" / "step_000003")
    save_steps(run_dir, model, optimizer, [5], keep_last=1)
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step_000004", "step_000005"]  # pruning counts complete ones only
    assert latest_checkpoint(str(run_dir)) == str(run_dir / "checkpoints" / "step_000005")


def test_an_optimizer_that_has_not_stepped_is_saved_and_resumed_as_it_is(
    tmp_path, tiny_model_dir, world_of_one
):
    """A checkpoint of step 0 (a signal after the warm start, before RL's first update) holds an AdamW that
    has not stepped: it stays so in the run that saves it and in the one that resumes, whose first update
    is then the one the run would have made. (DCP's state dict gives such an optimizer a first step of
    zeros, step 1 with moments 0, and the first update after the resume was ~0.74 of that one.)"""
    model, optimizer = build(tiny_model_dir)
    save_checkpoint(str(tmp_path / "run"), 0, {"policy": model}, {"policy": optimizer}, {}, CONFIG)
    assert not optimizer.state
    resumed, resumed_optimizer = build(tiny_model_dir)
    load_checkpoint(
        latest_checkpoint(str(tmp_path / "run")),
        {"policy": resumed},
        {"policy": resumed_optimizer},
    )
    assert not resumed_optimizer.state
    for m, o in [(model, optimizer), (resumed, resumed_optimizer)]:
        advance(m, o, 1)
    assert first_difference(full_state(resumed, resumed_optimizer), full_state(model, optimizer)) is None


class Payload:
    """Unpickling it creates a file: what a pickle can do is run code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.mark.parametrize("target", ["rank0.*", ".metadata"])
def test_a_pickle_in_a_checkpoint_is_refused_not_run(target, tmp_path, tiny_model_dir, world_of_one):
    import pickle
    model, optimizer = build(tiny_model_dir)
    run_dir = tmp_path / "run"
    save_steps(run_dir, model, optimizer, [1])
    sentinel = tmp_path / "pwned"
    [path] = (run_dir / "checkpoints" / "step_000001").glob(target)
    path.write_bytes(pickle.dumps(Payload(str(sentinel))))
    with pytest.raises(CheckpointError):
        load_checkpoint(str(run_dir / "checkpoints" / "step_000001"), {"policy": model}, {"policy": optimizer})
    assert not sentinel.exists()


def test_fresh_start_moves_the_old_run_aside(tmp_path, tiny_model_dir, world_of_one):
    model, optimizer = build(tiny_model_dir)
    run_dir = tmp_path / "run"
    save_steps(run_dir, model, optimizer, [1])
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    aside = start_fresh(str(run_dir))
    assert re.fullmatch(rf"{re.escape(str(run_dir))}\.old-\d{{8}}-\d{{6}}", aside)
    assert not run_dir.exists() and latest_checkpoint(str(run_dir)) is None  # nothing left to adopt
    assert sorted(os.listdir(aside)) == ["checkpoints", "metrics.jsonl"]  # nothing lost
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}")
    second = start_fresh(str(run_dir))
    assert second != aside and os.path.exists(os.path.join(second, "config.json"))
    assert start_fresh(str(run_dir)) is None  # nothing there


def test_resume_refuses_what_cannot_change_and_lists_what_does(tmp_path, tiny_model_dir, world_of_one):
    model, optimizer = build(tiny_model_dir)
    run_dir = tmp_path / "run"
    save_steps(run_dir, model, optimizer, [1, 2])  # CONFIG: the tiny preset, steps=20
    path = latest_checkpoint(str(run_dir))
    assert check_resume(path, make_config("tiny")) == []
    changed = check_resume(path, make_config("tiny", ["steps=40", "train.lr=3e-5", "eval.every=5", "train.keep_last=0"]))
    assert changed == ["steps: 20 -> 40", "train.lr: 0.0001 -> 3e-05", "train.keep_last: 2 -> 0", "eval.every: 0 -> 5"]
    with pytest.raises(ConfigError, match=r"cannot be resumed with these changes: algo: 'grpo' -> 'ppo'; rollout.group_size: 4 -> 2; "
                                          r"ppo.mini_batch_size: 16 -> 8\."):
        check_resume(path, make_config("tiny", ["algo=ppo", "rollout.group_size=2", "ppo.mini_batch_size=8", "train.lr=1e-3"]))
    # a task's own keys are declared fixed or not in its file (arithmetic: the training prompts are fixed)
    assert check_resume(path, make_config("tiny", ["task.num_val=16"])) == ["task.num_val: 32 -> 16"]
    with pytest.raises(ConfigError, match=r"cannot be resumed with these changes: "
                                          r"task.num_train: 2048 -> 100\."):
        check_resume(path, make_config("tiny", ["task.num_train=100"]))
    with pytest.raises(ConfigError, match="step_000002 is at step 2, beyond steps=1: resume with steps >= 2"):
        check_resume(path, make_config("tiny", ["steps=1"]))
    # a checkpoint of an older nanoagent, whose config.json holds the task's keys under their old names
    old_data = {**CONFIG["data"], "num_train": 2048, "num_val": 32, "index_dir": "data/hotpotqa/index"}
    old = {**CONFIG, "data": old_data, "rollout": {**CONFIG["rollout"], "search_top_k": 3}}
    del old["task"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(old, f)
    assert check_resume(path, make_config("tiny")) == []
    assert to_dict(from_dict(old)) == to_dict(make_config("tiny"))
    with open(os.path.join(path, "COMPLETE"), "w") as f:
        json.dump({"step": 2, "world_size": 2}, f)
    with pytest.raises(ConfigError, match="written by 2 ranks and this run has 1: .* resume on 2 ranks .*, "
                                          "or start a new run with resume=never .* or another run_dir"):
        check_resume(path, make_config("tiny"))


def test_resumed_optimizer_takes_this_runs_hyperparameters(tmp_path, tiny_model_dir, world_of_one):
    from nanoagent import update
    model, optimizer = build(tiny_model_dir)
    for group in optimizer.param_groups:
        group["weight_decay"] = 0.5
    save_steps(tmp_path / "run", model, optimizer, [1])
    model, optimizer = build(tiny_model_dir)
    load_checkpoint(latest_checkpoint(str(tmp_path / "run")), {"policy": model}, {"policy": optimizer})
    assert optimizer.param_groups[0]["weight_decay"] == 0.5  # what the checkpoint holds
    cfg = make_config("tiny", ["train.weight_decay=0.25", "train.lr=3e-5"])
    update.set_hyperparameters({"policy": optimizer}, 1, cfg)
    assert optimizer.param_groups[0]["weight_decay"] == 0.25 and optimizer.param_groups[0]["lr"] == 3e-5


def test_metrics_after_a_resume_hold_each_step_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in range(4)) + '{"step": 4, "rew')  # cut by a kill
    log = MetricsLog(str(tmp_path), 2, {})  # resumed from the checkpoint of step 2
    log.log({"step": 3, "reward": 0.0})
    assert [json.loads(line)["step"] for line in open(path)] == [0, 1, 2, 3]
    MetricsLog(str(tmp_path), None, {})  # a fresh start
    assert path.read_text() == ""
