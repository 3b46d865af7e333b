"""
What a new user ran into (issue 42): rollout.py evaluating a trained model under the run's own
config, not the defaults; TextWorld games found next to the prompt file that names them, whoever
reads it; a model name that cannot be loaded, a run folder or a checkpoint folder passed as a model,
refused at once in one line; build_index.py's default encoder, offline.
"""

import glob
import json
import os
import shutil
import socket
import sys

import pytest
from transformers import AutoTokenizer

import build_index
import chat
import procs
import rollout
import train
from nanoagent.agent import scripted_trajectories
from nanoagent.config import make_config, save_config
from nanoagent.data import load_prompts, write_prompts
from nanoagent import hub, retriever
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
