"""
What a new user ran into (issue 42): rollout.py evaluating a trained model under the run's own
config, not the defaults; TextWorld games found next to the prompt file that names them, whoever
reads it; a model name that cannot be loaded, a run folder or a checkpoint folder passed as a model,
refused at once in one line; build_index.py's default encoder, offline.

And on a busy 2-core machine (issue 59): a SIGTERM or a Ctrl-C in any phase of a run (the build, the
warm start, the evaluation at step 0) stops at a safe point with a checkpoint, or says there was nothing
to save, and prints the command that goes on, which goes on exactly; the warm start shows its progress
every step; data errors in one line (a missing or corrupt prompt file, a bad JSONL line by its number,
prepare_data.py offline); a refused run under torchrun said by the rank that knows why, alone and last;
the loggers: wandb's absence said in one line, TensorBoard's event files.
"""

import glob
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

import build_index
import chat
import procs
import rollout
import train
from nanoagent.agent import scripted_trajectories
from nanoagent.common import MetricsLog
from nanoagent.config import ConfigError, make_config, save_config
from nanoagent.data import load_prompts, write_prompts
from nanoagent import hub, retriever, tools
from nanoagent.tasks import arithmetic, task_data, textworld

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def test_rollout_evaluates_a_run_under_the_config_it_was_trained_with(tiny_model_dir, tmp_path, capsys):
    """<run_dir>/hf with the run's config.json beside it: rollout.py takes that config (another task,
    seed, turn and token budgets than the defaults) and says so."""
    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run / "hf")
    save_config(make_config("tiny", ["data.task=arithmetic",
                                     "seed=7",
                                     "rollout.max_turns=1",
                                     "rollout.max_new_tokens=4",
                                     "rollout.engine=hf"]),
                str(run / "config.json"))
    out = tmp_path / "rollouts.jsonl"
    assert rollout.main(["--model", str(run / "hf"), "--limit", "3", "--greedy", "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"rollout.py: config {run / 'config.json'}\n")
    rows = read_jsonl(out)
    # the tiny preset's task.num_val, the run's seed
    held_out = arithmetic.make_prompts(32, seed=7, split="val")[:3]
    assert [r["id"] for r in rows] == [p["id"] for p in held_out]
    assert [r["messages"][:2] for r in rows] == [p["messages"] for p in held_out]
    assert all(r["turns"] == 1 and len(r["response_ids"]) <= 4 for r in rows)


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    """Two real TextWorld games (an easy and a hard one), as make_one writes them: OUT/games/val-0000i.*"""
    out = tmp_path_factory.mktemp("games")
    made = [textworld.make_one((str(out), "val", kind, i, 7 + i)) for i, kind in enumerate(["easy", "hard"])]
    return made, out


def place(rows, games_out, folder):
    """Copy the rows' games (.z8, .json, .ni) to folder/games, where their relative paths lead from folder."""
    os.makedirs(folder / "games", exist_ok=True)
    for row in rows:
        for name in glob.glob(os.path.join(games_out, os.path.splitext(row["game"])[0] + ".*")):
            shutil.copy(name, folder / "games")


def test_a_runs_train_and_val_files_find_their_games_each_beside_itself(games, tiny_model_dir, tmp_path):
    """Training's train and val files in two folders, each with its own game beside it: each row plays
    its own game (the train row's was looked for beside the val file)."""
    rows, games_out = games
    train_dir, val_dir = tmp_path / "train", tmp_path / "val"
    place(rows[:1], games_out, train_dir)
    place(rows[1:], games_out, val_dir)
    write_prompts(str(train_dir), {"train": rows[:1]})
    write_prompts(str(val_dir), {"val": rows[1:]})
    cfg = make_config("tiny", ["data.task=textworld",
                               f"data.train_path={train_dir / 'train.parquet'}",
                               f"data.val_path={val_dir / 'val.parquet'}",
                               "data.max_prompt_tokens=1536",
                               "rollout.max_context_tokens=3072"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    train_rows, val_rows, env = task_data(textworld, cfg, tok)
    played = scripted_trajectories(env,
                                   train_rows + val_rows,
                                   [r["walkthrough"] for r in train_rows + val_rows])
    assert [t.env.won for t in played] == [True, True]


def test_rollout_finds_the_games_beside_its_data_file(games, tiny_model_dir, tmp_path):
    """rollout.py --data: a prompt file of its own with its games beside it; data.val_path (the tiny
    preset's, data/hotpotqa/val.parquet) has none, and its folder is where they were looked for."""
    rows, games_out = games
    other_dir = tmp_path / "other"
    place(rows, games_out, other_dir)
    with open(other_dir / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    out = tmp_path / "rollouts.jsonl"
    assert rollout.main(["--model", tiny_model_dir,
                         "--data", str(other_dir / "prompts.jsonl"),
                         "--config", "tiny",
                         "--out", str(out),
                         "data.task=textworld",
                         "rollout.engine=hf",
                         "rollout.max_turns=1",
                         "rollout.max_new_tokens=4",
                         "data.max_prompt_tokens=1536",
                         "rollout.max_context_tokens=3072"]) == 0
    trajectories = read_jsonl(out)
    # each game's own first room
    assert [t["messages"][:2] for t in trajectories] == [r["messages"] for r in rows]
    assert all(t["finish_reason"] != "env_error" and t["turns"] == 1 for t in trajectories)


def one_line_exit(main, argv, capsys):
    """A script's main refused argv: its exit status and its one line on stderr (no traceback)."""
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return exit.value.code, err


def test_a_model_that_cannot_be_loaded_is_refused_at_once_in_one_line(tmp_path, capsys, monkeypatch):
    """A path that does not exist; a hub id not in the cache while offline (the suite runs with
    HF_HUB_OFFLINE=1), refused by train.py, rollout.py and chat.py alike; a hub id in the cache is
    a model."""
    missing = str(tmp_path / "out" / "run" / "hf")
    assert "does not exist (no such folder, and not a hub id)" in hub.model_problem(missing)
    for main, argv, script in [(train.main, ["model=nosuch/model"], "train.py"),
                               (rollout.main, ["--model", "nosuch/model"], "rollout.py"),
                               (chat.main, ["--model", "nosuch/model", "--question", "hi"], "chat.py")]:
        status, err = one_line_exit(main, argv, capsys)
        assert status == 2 and err.startswith(f"{script}: 'nosuch/model' is no folder here"), err
        assert "HF_HUB_OFFLINE=1" in err, err
    # the hub's cache layout (what `hf download` leaves): HF_HUB_CACHE, which the hub client reads on import
    import huggingface_hub.constants
    snapshot = tmp_path / "hub" / "models--someone--model" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--someone--model" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--model" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub.model_problem("someone/model") is None and hub.model_problem("someone/other") is not None


def test_a_hub_that_does_not_answer_is_refused_within_seconds(tmp_path):
    """Online, a hub id the cache does not hold is asked about once, with a timeout: a hub that takes
    connections and never answers (a network that drops them) ends rollout.py in one line, status 2."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        env = {**os.environ,
               "HF_HUB_OFFLINE": "0",
               "HF_ENDPOINT": f"http://127.0.0.1:{silent.getsockname()[1]}",
               "HF_HUB_CACHE": str(tmp_path / "hub")}
        proc = procs.run([sys.executable, "rollout.py", "--model", "someone/model"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(
        "rollout.py: 'someone/model' is no folder here, and the hub did not answer for it"), proc.stderr


def test_a_run_folder_or_a_checkpoint_passed_as_a_model_is_named_with_the_export_to_pass(tmp_path, capsys):
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    save_config(make_config("tiny"), str(run / "config.json"))
    save_config(make_config("tiny"), str(checkpoint / "config.json"))
    (checkpoint / "COMPLETE").write_text('{"step": 2, "world_size": 1}')
    status, err = one_line_exit(rollout.main, ["--model", str(run)], capsys)
    assert status == 2 and err == (f"rollout.py: {str(run)!r} is a training run's folder, not a model: "
                                   f"pass its export {str(run / 'hf')!r} "
                                   f"(none yet: train.py writes it when the run ends)")
    (run / "hf").mkdir()
    assert hub.model_problem(str(run)).endswith(f"pass its export {str(run / 'hf')!r}")
    status, err = one_line_exit(chat.main, ["--model", str(checkpoint), "--question", "hi"], capsys)
    assert status == 2 and err == (f"chat.py: {str(checkpoint)!r} is a training checkpoint "
                                   f"(sharded, for resuming a run), "
                                   f"not a model: pass the run's export {str(run / 'hf')!r}")


def test_build_index_default_encoder_works_offline_and_search_loads_it(tmp_path, capsys):
    """No --encoder, offline: MiniLM from its package, recorded by its hub name, which search loads the
    same way; an encoder that cannot be loaded is one line."""
    corpus = tmp_path / "corpus.jsonl"
    passages = ["Nanotown is a river city founded by Ada Quill in 1802.",
                "Bolt is a dog who lives in Paris.",
                "The moon is far away."]
    corpus.write_text("".join(json.dumps({"id": i, "title": f"T{i}", "text": t}) + "\n"
                              for i, t in enumerate(passages)))
    assert build_index.main([f"--corpus={corpus}", f"--out={tmp_path / 'index'}"]) == 0
    assert json.loads((tmp_path / "index" / retriever.META).read_text())["encoder"] == retriever.MINILM
    [[top]] = retriever.IndexRetriever(str(tmp_path / "index")).search(["Who founded Nanotown?"], 1)
    assert top["id"] == "0"
    capsys.readouterr()
    for encoder, message in [("nosuch/encoder", "--encoder 'nosuch/encoder' is no folder here"),
                             (str(tmp_path), f"cannot load the encoder {str(tmp_path)!r}")]:
        with pytest.raises(SystemExit) as exit:
            build_index.main([f"--corpus={corpus}", f"--out={tmp_path / 'other'}", f"--encoder={encoder}"])
        assert str(exit.value).startswith(f"build_index.py: {message}"), exit.value
        assert len(str(exit.value).splitlines()) == 1, exit.value


# -----------------------------------------------------------------------------
# issue 59: stops, data errors, torchrun, loggers

# the tiny model on arithmetic: a warm start of 12 steps, the evaluation at step 0, one GRPO step
STOPPABLE = [
    "--config=tiny",
    "train.warm_start_steps=12", "train.warm_start_batch_size=8",
    "rollout.engine=hf",
    "steps=1",
    "eval.every=1", "task.num_val=8",
    "rollout.prompts_per_step=4", "rollout.max_turns=2",
    "ppo.mini_batch_size=8",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def sigterm_after(cmd, text, log):
    """Run cmd (its output to log), SIGTERM it once its output holds text; its exit status and output."""
    with open(log, "w") as out:
        proc = procs.start(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=ENV)
    while text not in open(log).read():
        assert proc.poll() is None, open(log).read()[-3000:]
        time.sleep(0.05)
    proc.terminate()
    return proc.wait(timeout=600), open(log).read()


def go_on(out, how="to go on"):
    """The command a stopped run printed, as a list, its python as an absolute path (it prints make's
    .venv/bin/python as make names it, relative to the checkout it runs in)."""
    found = re.search(rf"; {how}: (.*)$", out, re.MULTILINE)
    assert found, out[-3000:]
    python, *args = shlex.split(found.group(1))
    return [os.path.join(ROOT, python), *args]


@pytest.mark.slow
def test_a_signal_in_any_phase_stops_at_a_safe_point_and_the_command_it_prints_goes_on_exactly(tmp_path):
    """
    One run, stopped in each phase before RL: during the build (nothing to save, the run folder left as it
    was), during the warm start (a checkpoint at the next warm-start step), during its last step, whose
    export and evaluation at step 0 end first (a checkpoint of step 0, the warm start kept); each time the
    command it printed goes on, and the run it makes is the one a run never stopped makes beside it: the
    same warm-start losses, the same warm-started weights, the same metrics and the same weights after the
    RL step. The warm start says every step how far it is, with its elapsed time and ETA.
    """
    run_dir, straight_dir = tmp_path / "run", tmp_path / "straight"
    cmd = [sys.executable, "train.py", *STOPPABLE, f"run_dir={run_dir}"]
    straight = procs.start([sys.executable, "train.py", *STOPPABLE, f"run_dir={straight_dir}"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=ENV)
    # the build: the config is printed before it starts
    code, out = sigterm_after(cmd, "run_dir = ", tmp_path / "0.log")
    assert (
        code == 143 and "SIGTERM during the start: nothing to save (the run folder is as it was)" in out
    ), out[-3000:]
    assert not run_dir.exists() and go_on(out, "to start again") == cmd
    # the warm start: stopped at the next step boundary
    code, out = sigterm_after(go_on(out, "to start again"), "warm start    3/12", tmp_path / "1.log")
    stopped = re.search(r"SIGTERM during the warm start: checkpoint of its step (\d+)/12 written", out)
    assert code == 143 and stopped and 3 <= int(stopped.group(1)) < 12, out[-3000:]
    for step in range(1, int(stopped.group(1)) + 1):
        assert re.search(
            rf"^warm start {step:4d}/12 \| nll \d+\.\d{{4}} \| 8 demonstrations \| elapsed \d+s eta \d+s$",
            out,
            re.MULTILINE,
        ), out
    assert go_on(out) == [*cmd, "resume=auto"] and not (run_dir / "warm_start").exists()
    first = out
    # its last step: the export and the evaluation at step 0 end, then a checkpoint of step 0
    code, out = sigterm_after(go_on(out), "warm start   12/12", tmp_path / "2.log")
    assert (
        f"warm start resumed from {run_dir}/warm_start_progress/checkpoints/"
        f"step_{int(stopped.group(1)):06d}" in out
    )
    assert (
        code == 143 and "SIGTERM during the evaluation at step 0: checkpoint of step 0 written" in out
    ), out[-3000:]
    assert sorted(os.listdir(run_dir)) == [
        "checkpoints", "config.json", "metrics.jsonl", "trajectories.jsonl", "warm_start"
    ]  # its progress gone
    losses = re.findall(r"^warm start +\d+/12 \| nll \S+", first + out, re.MULTILINE)
    # RL goes on from step 0, with neither the warm start nor the evaluation again
    proc = procs.run(go_on(out), capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resumed from {run_dir}/checkpoints/step_000000 at step 0" in proc.stdout
    assert "warm start" not in proc.stdout and "step    0 |" not in proc.stdout
    assert straight.wait(timeout=600) == 0
    straight_out = straight.stdout.read()
    assert losses == re.findall(r"^warm start +\d+/12 \| nll \S+", straight_out, re.MULTILINE)
    timing = re.compile(r"^time/|tokens_per_s$")
    metrics = [
        [
            {k: v for k, v in m.items() if not timing.search(k)}
            for m in map(json.loads, open(d / "metrics.jsonl"))
        ]
        for d in (run_dir, straight_dir)
    ]
    assert [m["step"] for m in metrics[0]] == [0, 1] and metrics[0] == metrics[1]
    for weights in ["warm_start/model.safetensors", "hf/model.safetensors"]:
        assert (run_dir / weights).read_bytes() == (straight_dir / weights).read_bytes(), weights


def test_data_errors_are_one_line_naming_the_file_and_a_jsonl_row_by_its_line(
    tmp_path, tiny_model_dir, capsys
):
    """A prompt file that is missing, or a parquet file that does not read, or a JSONL row that cannot be
    trained on: one line (ConfigError, which train.py prints as it prints a config error:
    tests/test_train.py, test_a_start_that_fails_leaves_the_run_folder_as_it_was), naming the file, and the
    bad row by its line (1-based, blank lines counted) when it has no id; a search index that is not there,
    too; rollout.py --data says the same in one line."""
    with pytest.raises(
        ConfigError, match=r"prompt file '.*nosuch.parquet' does not exist \(write it with prepare_data.py\)"
    ):
        load_prompts(str(tmp_path / "nosuch.parquet"))
    good = tmp_path / "good.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"id": "a", "messages": json.dumps([{"role": "user", "content": "q"}])}]),
        good,
    )
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(good.read_bytes()[:len(good.read_bytes()) // 2])  # a copy cut short
    with pytest.raises(
        ConfigError,
        match=r"prompt file '.*corrupt.parquet' is not a parquet file that reads \(.*magic bytes "
        r"not found in footer.*\); write it again with prepare_data.py",
    ) as error:
        load_prompts(str(corrupt))
    assert len(str(error.value).splitlines()) == 1
    jsonl = tmp_path / "p.jsonl"
    row = json.dumps({"id": "a", "messages": [{"role": "user", "content": "q"}]})
    jsonl.write_text(f"{row}\n\n{{\"id\": \"cut\", \"messa\n")  # line 3, after a blank one
    with pytest.raises(
        ConfigError,
        match=r"p.jsonl: 1 of 2 prompts cannot be trained on \(first: line 3 \(not a JSON object\)\)",
    ):
        load_prompts(str(jsonl))
    with pytest.raises(
        ConfigError, match=rf"^no search index at {tmp_path} \(.*meta.json is missing\); build one with "
    ):
        tools.make_tools(["search"], str(tmp_path))  # a search task's task.index_dir
    assert rollout.main(["--model", tiny_model_dir, "--config", "tiny", "--data", str(corrupt)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1
        and err.startswith(f"rollout.py: prompt file '{corrupt}' is not a parquet file")
    ), err


def test_prepare_data_offline_names_source_and_leaves_no_folder(tmp_path):
    """GSM8K from the hub, offline (and with an empty datasets cache): one line that names --source, and
    the folder it made is gone (it was left empty)."""
    out = tmp_path / "gsm8k"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_DATASETS_CACHE": str(tmp_path / "hf"),
    }
    proc = procs.run([sys.executable, "prepare_data.py", "--task=gsm8k", f"--out={out}"],
                     capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert (
        proc.stderr.startswith("prepare_data.py: Couldn't reach 'openai/gsm8k' on the Hub")
        and "pass --source=DIR" in proc.stderr
    )
    assert not out.exists()


def refused_run(run_dir):
    """A run folder whose checkpoint (of 1 rank) a run on 2 ranks must refuse."""
    checkpoint = run_dir / "checkpoints" / "step_000001"
    checkpoint.mkdir(parents=True)
    save_config(make_config("tiny"), str(checkpoint / "config.json"))
    (checkpoint / "COMPLETE").write_text('{"step": 1, "world_size": 1}')
    return f"{checkpoint} was written by 1 ranks and this run has 2"


@pytest.mark.slow
def test_a_run_refused_under_torchrun_is_said_by_rank_0_alone_and_last(tmp_path):
    """
    A resume refused on 2 gloo ranks (its checkpoint is of 1 rank): no rank's traceback (the reason was
    buried under ~60 lines of rank 1's gloo connectFullMesh traceback), and the reason, in one line, ends
    torchrun's own report of the failure, whichever rank was refused first (rank 0 says it too, unless
    torchrun stopped it first: every rank is refused alike). The refusal comes before the process group
    exists: a rank 0 whose other rank never comes is refused at once rather than left waiting for it.
    """
    reason = refused_run(tmp_path / "run")
    cmd = [
        *procs.torchrun(2),
        "train.py", "--config=tiny", "rollout.engine=hf", f"run_dir={tmp_path / 'run'}",
    ]
    proc = procs.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=ENV)
    out = proc.stdout + proc.stderr
    assert (
        proc.returncode != 0
        and "[rank" not in out
        and "connectFullMesh" not in out
        and len(out.splitlines()) < 50
    ), out
    line = f"train.py: error: {reason}: the data position and the RNG states are per rank; resume on 1 ranks"
    # the root cause's, above the last rule
    assert out.rstrip().splitlines()[-2].startswith("  traceback : " + line), out
    assert all(
        said.startswith((line, "  traceback : " + line)) for said in out.splitlines() if reason in said
    ), out
    alone = {**ENV, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(procs.free_port())}
    proc = procs.run(
        [sys.executable, "train.py", "--config=tiny", "rollout.engine=hf", f"run_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=alone,
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[0].startswith(line), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_make_demo_smollm2_goes_on_with_resume_auto(tmp_path):
    """make demo-smollm2 RESUME=auto keeps both stages' folders, runs the imitation only while its
    warm_start is not written and resumes the rest; plain make demo-smollm2 starts afresh."""
    for resume, removes in [("auto", False), (None, True)]:
        # --no-print-directory: under make test (an outer make) make -n would begin with "Entering directory"
        plan = subprocess.run(["make", "-n", "--no-print-directory", "demo-smollm2",
                               *([f"RESUME={resume}"] if resume else [])],
                              cwd=ROOT, capture_output=True, text=True, check=True).stdout
        plan = plan.replace("\\\n\t", "")  # continued lines, joined as the shell joins them
        mode = resume or "never"
        assert (f"train.py --config=demo-smollm2-imitation seed=0 run_dir=out/demo-smollm2/imitation "
                f"resume={mode}\n") in plan
        assert (f"train.py --config=demo-smollm2 seed=0 model=out/demo-smollm2/imitation/warm_start "
                f"run_dir=out/demo-smollm2/run resume={mode}\n") in plan
        # what runs before train.py, with the removal said instead of done
        guard, imitation = plan.splitlines()[:2]
        said = subprocess.run(["bash", "-c", guard.replace("rm -rf", "echo rm -rf")],
                              capture_output=True, text=True).stdout
        assert (said == "rm -rf out/demo-smollm2/imitation out/demo-smollm2/run\n") == removes, plan
    # the first stage runs (said, not run) until its warm start is written
    def said_by_imitation():
        command = imitation.replace(".venv/bin/python", "echo")
        return subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True).stdout

    assert "train.py" in said_by_imitation()
    (tmp_path / "out/demo-smollm2/imitation/warm_start").mkdir(parents=True)
    assert said_by_imitation() == ""


@pytest.mark.parametrize("package", ["wandb", "tensorboard"])
def test_a_logger_whose_package_is_missing_is_refused_in_one_line(package, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed: importing it raises ImportError
    with pytest.raises(SystemExit):
        train.parse_args(["--config=tiny", f"log.{package}=true"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    # the program's name as argparse gives it (train.py; pytest's own in this process)
    assert last.split(": ", 1)[1].startswith(
        f"error: log.{package}=true but the {package} package is not installed: "
    ), last
    assert ("pip install wandb" if package == "wandb" else "make install installs it") in last


def test_tensorboard_event_files_hold_each_step_once_across_a_resume(tmp_path):
    """log.tensorboard=true: every number of a step's metrics line, under its name, in run_dir/tensorboard;
    a resume from the checkpoint of step 2 hides what the run before logged after it, as metrics.jsonl
    drops it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    first = MetricsLog(str(tmp_path), None, {}, tensorboard=True)
    for step in [0, 1, 2, 3]:
        first.log({"step": step, "reward": step / 10, "finish/done": 1.0})
    first.tensorboard.close()
    resumed = MetricsLog(str(tmp_path), 2, {}, tensorboard=True)
    resumed.log({"step": 3, "reward": 0.9, "finish/done": 0.5})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["finish/done", "reward"]
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("reward")] == [
        (0, 0.0), (1, 0.1), (2, 0.2), (3, 0.9)
    ]
    assert [e.value for e in events.Scalars("finish/done")] == [1.0, 1.0, 1.0, 0.5]
    assert [json.loads(line)["reward"] for line in open(tmp_path / "metrics.jsonl")] == [0.0, 0.1, 0.2, 0.9]
