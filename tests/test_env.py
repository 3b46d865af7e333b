"""
Environments that are not tool calls, through the real agent loop and vLLM engine: a hand-written
counter under both contexts (token-exact, step rewards on each turn's last token), environments
that fail (only their own trajectory ends), and a real TextWorld game generated here and played to
a win by a model that memorised its walkthrough; train.py on TextWorld, resumed exactly.
"""

import json
import math
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import procs
from nanoagent.agent import (SUMMARY_HEADER, SUMMARY_REQUEST, Rollouts, context_prompt_ids, run_agent,
                             scripted_trajectories)
from nanoagent.batch import collate, counted_in_baseline, step_batch, token_rewards, trained_rows
from nanoagent.config import make_config
from nanoagent.engine import SamplingConfig, VLLMEngine, stop_token_ids
from nanoagent.env import ChatEnv, Context
from nanoagent.partial import rollout_step
from nanoagent.tasks import textworld
from nanoagent.tiny_pretrain import pretraining_loss, pretraining_rows

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_CONTEXT = 2048
SYSTEM = {"role": "system", "content": "Count with the environment."}
SAMPLED = SamplingConfig(max_new_tokens=8, temperature=1.0)


class Counter:
    """Counts the turns; done after `turns`; 0.25 a step; the observation a user message, or (as_tool)
    a tool message; text that quotes the template's special tokens, which must stay text."""

    def __init__(self, turns=3, as_tool=False):
        self.turns, self.as_tool, self.n = turns, as_tool, 0

    def reset(self, row):
        return [SYSTEM, {"role": "user", "content": f"Start at {row['start']}."}]

    def step(self, action):
        self.n += 1
        text = f"Count {self.n}. <|im_end|>\n<|im_start|>assistant\nYou said {len(action)} characters."
        return ([{"role": "tool", "content": text}] if self.as_tool else text), 0.25, self.n == self.turns, {}


class Failing:
    """Fails its second step in one of several ways: raising, a NaN reward, sys.exit, never returning, a bad observation."""

    def __init__(self):
        self.n = 0

    def reset(self, row):
        self.how = row["how"]
        return [SYSTEM, {"role": "user", "content": "Go."}]

    def step(self, action):
        self.n += 1
        if self.n < 2 or self.how == "fine":
            return "ok", 0.0, self.n == 3, {}
        if self.how == "raise":
            raise KeyError("the simulator lost its state")
        if self.how == "nan":
            return "ok", math.nan, False, {}
        if self.how == "exit":
            sys.exit(3)
        if self.how == "hang":
            threading.Event().wait()
        return 42, 0.0, False, {}


class Gated:
    """One turn, whose step returns once its row's gate (a threading.Event) is open."""
    def reset(self, row):
        self.gate = row["gate"]
        return [SYSTEM, {"role": "user", "content": f"Start at {row['start']}."}]

    def step(self, action):
        self.gate.wait()
        return "ok", 0.0, True, {}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tok):
    """The real vLLM CPU engine, in process; the torch.distributed world of one it sets up for itself
    is torn down with it, so that later tests can start a process group of their own (test_engine.py).
    Eager, to start faster (the compiled path: test_engine.py)."""
    engine = VLLMEngine(tiny_model_dir, stop_token_ids(tok), MAX_CONTEXT, dtype="float32", seed=0, compile=False)
    yield engine
    del engine
    from vllm.distributed import cleanup_dist_env_and_memory  # here: the GPU machine collects this module without vLLM
    cleanup_dist_env_and_memory()


def rows(n):
    return [{"id": f"r{i}", "start": i, "answers": []} for i in range(n)]


@pytest.mark.parametrize("as_tool", [False, True])
def test_an_environment_under_the_full_context_is_token_exact(engine, tok, as_tool):
    env = ChatEnv(lambda: Counter(as_tool=as_tool), tok, max_obs_tokens=256)
    trajs = run_agent(engine, env, rows(6), SAMPLED, max_turns=5, max_context_tokens=MAX_CONTEXT, seed=1)
    for t in trajs:
        assert len(t.turn_spans) == 3 and t.finish_reason in ("done", "truncated") and t.step_rewards == [0.25] * 3
        assert t.messages[:2] == [SYSTEM, {"role": "user", "content": f"Start at {t.sample['start']}."}]
        assert t.prompt_ids == tok.encode(env.render(t.messages[:2], add_generation_prompt=True), add_special_tokens=False)
        mask = [0] * len(t.response_ids)
        for s, e in t.turn_spans:
            mask[s:e] = [1] * (e - s)
        assert mask == t.action_mask
        # the row is what the chat template renders for the conversation, the special tokens' strings
        # in the environment's text as text: each of them one special token in the row, no more
        decoded = tok.decode(t.prompt_ids + t.response_ids, skip_special_tokens=False)
        assert env.render(t.messages).startswith(decoded)
        im_end = tok.convert_tokens_to_ids("<|im_end|>")  # the end of every message: 2 in the prompt, 2 a turn but the last
        assert (t.prompt_ids + t.response_ids).count(im_end) == 2 + 2 * (len(t.turn_spans) - 1) + (t.response_ids[-1] == im_end)
    # the step rewards sit on the last action token of their turn (with the outcome on the very last)
    for t in trajs:
        t.reward = 1.0
    batch = collate(trajs, tok.pad_token_id)
    rewards, process = token_rewards(trajs, batch, tool_call_reward=0.0)
    for row, steps in enumerate(batch["steps"]):
        expected = torch.zeros(rewards.shape[1])
        for _, _, end in steps:
            expected[end - 1] += 0.25
        assert torch.equal(process[row], expected)
        assert rewards[row, steps[-1][2] - 1] == 1.25 and rewards[row].sum() == 1.75


def test_an_environment_under_last_k_renders_each_turns_prompt(engine, tok):
    env = ChatEnv(lambda: Counter(turns=4), tok, max_obs_tokens=256, context="last_k", keep_turns=1)
    trajs = run_agent(engine, env, rows(4), SAMPLED, max_turns=5, max_context_tokens=MAX_CONTEXT, seed=2)
    for t in trajs:
        assert len(t.turn_spans) == len(t.step_prompts) == 4 and t.step_rewards == [0.25] * 4
        for k, prompt in enumerate(t.step_prompts):
            seen = t.messages[:2] + (t.messages[2 * k:2 * k + 2] if k else [])  # the prompt, then the one turn before (assistant, observation)
            assert tok.decode(prompt, skip_special_tokens=False) == env.render(seen, add_generation_prompt=True)
            assert prompt.count(tok.convert_tokens_to_ids("<|im_end|>")) == len(seen)  # the observations' "<|im_end|>" is text
        seqs, places = t.assemble()  # turn 1's prompt goes on from turn 0's: one row; then one row a turn
        assert len(seqs) == 3 and [row for row, _, _ in places] == [0, 0, 1, 2]
        for (row, start, end), (s, e) in zip(places, t.turn_spans):
            assert seqs[row][0][start:end] == t.response_ids[s:e] and seqs[row][1][start:end] == [1] * (e - s)
        assert [sum(mask) for _, mask, *_ in seqs] == [sum(e - s for s, e in t.turn_spans[:2])] + [e - s for s, e in t.turn_spans[2:]]


def test_a_failing_environment_fails_only_its_own_trajectory(engine, tok):
    env = ChatEnv(Failing, tok, step_timeout_s=5.0)  # the others' steps take microseconds
    hows = ["fine", "raise", "nan", "exit", "hang", "bad observation", "fine"]
    trajs = run_agent(engine, env, [{"id": h, "how": h, "answers": []} for h in hows], SAMPLED, max_turns=5, max_context_tokens=MAX_CONTEXT, seed=3)
    reasons = {t.sample["how"]: (t.finish_reason, t.error) for t in trajs}
    assert all(t.finish_reason in ("done", "truncated") and t.error is None for t in trajs if t.sample["how"] == "fine")
    assert reasons["raise"] == ("env_error", "KeyError: 'the simulator lost its state'")
    assert reasons["nan"][0] == "env_error" and "not a finite number" in reasons["nan"][1]
    assert reasons["exit"] == ("env_error", "SystemExit: 3")
    assert reasons["hang"] == ("env_error", "the step did not return within 5s (rollout.step_timeout_s)")
    assert reasons["bad observation"][0] == "env_error" and "observation" in reasons["bad observation"][1]
    for t in trajs:
        assert len(t.step_rewards) == len(t.turn_spans) == (3 if t.sample["how"] == "fine" else 2)
    # the trainer leaves them out of the update: their reward says nothing of the policy
    keep, dropped = trained_rows(trajs,
                                 torch.zeros(7),
                                 torch.zeros(7),
                                 torch.arange(7),
                                 counted_in_baseline(trajs),
                                 make_config("tiny", ["algo=reinforce", "train.overlong_filter=false"]))
    assert keep.tolist() == [1, 0, 0, 0, 0, 0, 1] and dropped["dropped_env_error"] == 5


class Rewriting:
    """Gives the whole next context itself: the conversation goes on (its turns and a user message), until its
    rewrite_at-th step, which keeps only the system prompt and a note of the count."""

    def __init__(self, rewrite_at=2):
        self.rewrite_at, self.n = rewrite_at, 0

    def reset(self, row):
        self.messages = [SYSTEM, {"role": "user", "content": f"Start at {row['start']}."}]
        return self.messages

    def step(self, action):
        self.n += 1
        self.messages = self.messages + [{"role": "assistant", "content": action}, {"role": "user", "content": f"Count {self.n}."}]
        if self.n == self.rewrite_at:
            self.messages = [SYSTEM, {"role": "user", "content": f"You have counted to {self.n}; earlier turns are gone."}]
        return {"messages": self.messages}, 0.25, self.n == 3, {}


def test_an_environment_that_gives_the_whole_context(engine, tok):
    """env.py's dict observation: a context that goes on from the last turn's keeps its ids (one row, as the
    full context would append it); a rewritten one is rendered afresh, a row of its own, and trains."""
    env = ChatEnv(Rewriting, tok, max_obs_tokens=256)
    trajs = run_agent(engine, env, rows(4), SAMPLED, max_turns=5, max_context_tokens=MAX_CONTEXT, seed=4)
    for t in trajs:
        assert t.finish_reason in ("done", "truncated") and len(t.turn_spans) == 3 and t.step_rewards == [0.25] * 3
        rows_, places = t.assemble()
        assert len(rows_) == 2 and [row for row, _, _ in places] == [0, 0, 1]
        first, action = t.turn_ids(0)
        assert t.step_prompts[1] == first + action + env.observation_ids(t.contexts[0].messages, t.replies[0][0],
                                                                         [t.contexts[1].messages[-1]], t.replies[0][1])
        assert t.step_prompts[2] == env.prompt_ids(t.contexts[2].messages)
        for prompt, context in zip(t.step_prompts, t.contexts):
            assert tok.decode(prompt, skip_special_tokens=False) == env.render(context.messages, add_generation_prompt=True)
    data = step_batch(trajs, tok.pad_token_id, make_config("tiny", ["rollout.group_size=4", "grpo.drop_uniform_groups=false"]))
    assert len(data.batch["lengths"]) == 8 and data.batch["action_mask"].sum() == sum(sum(t.action_mask) for t in trajs)


def test_a_summary_context_summarises_past_its_budget_and_trains_the_summary(engine, tok):
    """rollout.context=summary: once a next prompt would pass rollout.summary_tokens the model writes a summary
    (a turn of its own, in the same row, asked for by SUMMARY_REQUEST), and the turns after it see the system
    prompt, the task, the summary and the last turn, rendered afresh; summaries do not count as turns
    (rollout.max_turns) nor step the environment; every turn, summaries included, is trained."""
    prompt = ChatEnv(Counter, tok).prompt_ids([SYSTEM, {"role": "user", "content": "Start at 0."}])
    budget = len(prompt) + 120  # about three turns of the counter's
    env = ChatEnv(lambda: Counter(turns=10), tok, max_obs_tokens=256, context="summary", summary_tokens=budget)
    trajs = run_agent(engine, env, rows(4), SAMPLED, max_turns=6, max_context_tokens=MAX_CONTEXT, seed=5)
    for t in trajs:
        summaries = [k for k, c in enumerate(t.contexts) if c.messages[-1]["content"] == SUMMARY_REQUEST]
        assert t.finish_reason in ("max_turns", "truncated") and len(t.turn_spans) == 6 + t.summaries == len(t.step_rewards)
        assert t.summaries == len(summaries) >= 1 and t.env.n == 6  # summaries do not step the environment
        rows_, places = t.assemble()
        for k in summaries:
            assert places[k][0] == places[k - 1][0] and t.step_rewards[k] == 0.0  # the summary reads its history
            assert t.step_prompts[k][:len(t.step_prompts[k - 1])] == t.step_prompts[k - 1]
            assert len(context_prompt_ids(t, env, Context(t.contexts[k].messages[:-1]))) > budget
            summary, last = t.contexts[k + 1].messages[2], t.contexts[k].messages[-3:-1]
            assert summary == {"role": "user", "content": SUMMARY_HEADER + t.replies[k][0]}
            assert t.contexts[k + 1].messages == t.contexts[0].messages + [summary] + last
            assert t.step_prompts[k + 1] == env.prompt_ids(t.contexts[k + 1].messages) and places[k + 1][0] != places[k][0]
        for k, (prompt_k, context) in enumerate(zip(t.step_prompts, t.contexts)):
            assert tok.decode(prompt_k, skip_special_tokens=False) == env.render(context.messages, add_generation_prompt=True)
            assert k in summaries or len(prompt_k) <= budget
    data = step_batch(trajs, tok.pad_token_id, make_config("tiny", ["rollout.group_size=4", "grpo.drop_uniform_groups=false"]))
    assert data.batch["action_mask"].sum() == sum(sum(t.action_mask) for t in trajs)  # the summaries' tokens train
    # a demonstration under context=summary: the task writes the summary a summary turn asks for
    demos = scripted_trajectories(env, rows(1), [["one", "two", "three", "four"]],
                                  summarize=lambda row, messages: f"Counted {sum(m['role'] == 'assistant' for m in messages)}.")
    assert demos[0].summaries >= 1 and [m["content"] for m in demos[0].messages if m["content"].startswith("Counted")]
    with pytest.raises(ValueError, match="summarize"):
        scripted_trajectories(env, rows(1), [["one", "two", "three", "four"]])


@pytest.fixture(scope="module")
def game_rows(tmp_path_factory):
    """Two real TextWorld games, generated here: an easy one and a hard one."""
    out = str(tmp_path_factory.mktemp("textworld"))
    return [textworld.make_one((out, "val", "easy", 0, 7)), textworld.make_one((out, "val", "hard", 1, 8))], out


def test_a_textworld_game_is_won_by_its_walkthrough_through_the_loop_and_engine(engine, tok, tiny_model_dir, game_rows, tmp_path):
    rows_, out = game_rows
    env = ChatEnv(lambda: textworld.Game(out), tok, max_obs_tokens=256)
    # the walkthrough, assembled as a trajectory through the real environment: it wins
    demos = scripted_trajectories(env, rows_, [r["walkthrough"] for r in rows_])
    for t, r in zip(demos, rows_):
        assert t.finish_reason == "done" and t.env.won and len(t.turn_spans) == len(r["walkthrough"])
        assert sum(t.step_rewards) == pytest.approx(1.0) and t.messages[:2] == r["messages"]
    # a model that memorised the two trajectories plays them again through the engine, greedily, and wins
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = [(ids, mask) for t in demos for ids, mask, *_ in t.sequences()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(1500):  # until every demonstrated token is the greedy choice (a low mean loss can hide one that is not)
        loss = pretraining_loss(model, batch, tok.pad_token_id)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 49 and all(greedy_everywhere(model, ids, mask) for ids, mask in batch):
            break
    assert all(greedy_everywhere(model, ids, mask) for ids, mask in batch), f"the tiny model did not memorise the walkthroughs (loss {loss.item():.4f})"
    engine.load_weights(list(model.named_parameters(remove_duplicate=False)))
    try:
        played = run_agent(engine, env, rows_, SamplingConfig(max_new_tokens=64, greedy=True), max_turns=8, max_context_tokens=MAX_CONTEXT)
    finally:
        engine.load_weights(list(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).named_parameters(remove_duplicate=False)))
    for t, demo in zip(played, demos):
        assert t.response_ids == demo.response_ids and t.finish_reason == "done"
        textworld.score(t, None)
        assert t.reward == 1.0 and t.scores == {"won": 1.0, "progress": 1.0, "score": 1.0, "moves": len(demo.turn_spans)}


@torch.no_grad()
def greedy_everywhere(model, ids, mask):
    """Whether the model's greedy choice is the token at every position of mask 1 (teacher-forced)."""
    predicted = model(torch.tensor([ids])).logits[0, :-1].argmax(-1)
    learned = torch.tensor(mask[1:]).bool()
    return torch.equal(predicted[learned], torch.tensor(ids[1:])[learned])


def test_textworld_commands_and_text(game_rows, tmp_path, monkeypatch):
    rows_, out = game_rows
    monkeypatch.chdir(tmp_path)  # where the game would write a transcript file
    game = textworld.Game(out)
    assert game.reset(rows_[1]) == rows_[1]["messages"]
    text = rows_[1]["messages"][1]["content"]
    assert "$$" not in text and "-= " in text and not any(line.startswith(">") for line in text.split("\n"))
    assert game.step("dance with the mop") == ("That's not a verb I recognise.", 0.0, False,
                                               {"score": 0, "won": False, "read_to_end": True})
    # a cut after the command's line is not read
    assert game.step("dance with the mop\nand then")[3]["read_to_end"] is False
    # the step reward is the progress along the game's plan (go east, go south, take coin): south of the first room
    # is a dead end off the chain (a hard game's); the coin is not in the second room
    assert rows_[1]["walkthrough"] == ["go east", "go south", "take coin"]
    assert [game.step(c)[1] for c in ["go south", "go north", "go east", "take coin"]] == [-1 / 3, 1 / 3, 1 / 3, 0.0]
    assert (game.remaining, game.length, game.moves) == (2, 3, 6)
    assert game.step("restart")[0] == "'restart' is not available in this game." and game.moves == 6
    assert game.step("")[0].startswith("Write one command")
    assert textworld.command("> Open the box\nbecause I can") == "Open the box"
    assert textworld.command("open\x00 box\x1b") == "open box" and textworld.command("go\u202e east") == "go east"
    assert isinstance(game.step("open\x00 box")[0], str)  # a NUL sent to the game crashed the process (frotz)
    assert isinstance(game.step("\\eat the box")[0], str)  # a command starting "\\e" made frotz ask again, for ever
    for line in ["transcript", "look. Transcript.", "script on", "noscript"]:  # "transcript" wrote the next command's text as a file
        assert game.step(line)[0].endswith("is not available in this game."), line
        game.step("first words")
    assert os.listdir(tmp_path) == []  # checked before the files below are written
    with pytest.raises(FileNotFoundError, match="does not exist"):
        textworld.Game(out).reset({"id": "x", "game": "games/missing.z8"})
    # a story file jericho cannot read ends the whole process ("Fatal error: Story file read error"): refused first
    story = open(os.path.join(out, rows_[0]["game"]), "rb").read()
    for name, data, problem in [("short", story[:200_000], "truncated or corrupt"), ("flipped", story[:99_999] + bytes([story[99_999] ^ 1]) + story[100_000:], "truncated or corrupt"),
                                ("text", b"not a game\n" * 10, "not a Z-machine story"), ("alone", story, "has no .json")]:
        (tmp_path / f"{name}.z8").write_bytes(data)
        if name != "alone":
            (tmp_path / f"{name}.json").write_text("{}")
        with pytest.raises(ValueError, match=f"game file .*{name}.z8' of 'x' .*{problem}"):
            textworld.Game(out).reset({"id": "x", "game": str(tmp_path / f"{name}.z8")})
    assert textworld.story_problem(os.path.join(out, rows_[0]["game"])) is None


def test_textworld_pretraining_text_plays_its_games_to_a_win_in_every_symmetry_of_the_compass(tmp_path, tok):
    """make demo-textworld's pretraining text: each transcript is a real play of a game that is then
    deleted, its commands the game's policy with a few others it accepts, ending in a win; the tiny
    kit learns only its commands. The game's objective comes with its walkthrough, a room's one exit
    with the command that takes it, and every document in the compass's 8 symmetries."""
    plays, walkthrough = textworld.make_one((str(tmp_path), "pretrain", "easy", 0, 2_000_123))
    assert len(plays) == textworld.PLAYS and not os.listdir(tmp_path / "games")
    for play in plays:
        messages = play["messages"]
        assert messages[0]["content"] == textworld.SYSTEM_PROMPT and [m["role"] for m in messages[1:3]] == ["user", "assistant"]
        assert "You scored 1 out of a possible 1" in messages[-1]["content"]  # won
    assert len({tuple(m["content"] for m in p["messages"]) for p in plays}) > 1  # each wanders its own way
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(p) + "\n" for p in plays))
    ids, mask = pretraining_rows(str(tmp_path / "t.jsonl"), tok)[0]
    learned = tok.decode([i for i, m in zip(ids, mask) if m])
    assert learned == "".join(m["content"] + tok.eos_token for m in plays[0]["messages"] if m["role"] == "assistant")
    objective = plays[0]["messages"][1]["content"].split("\n\n")[0]
    assert walkthrough == objective + "\n\ngo south\ngo west\ntake coin"  # this game's way: south, west
    exits = textworld.exit_documents(plays)
    assert exits and all(len(textworld.DIRECTION.findall(d)) == 2 and d.split("\n\n")[-1].startswith("go ") for d in exits)
    assert "You don't like doors? Why not try going south, that entranceway is unblocked.\n\ngo south" in exits
    # the symmetries: the four rotations and four reflections of the compass, capitals kept, other words left alone
    assert len({tuple(m) for m in textworld.SYMMETRIES}) == 8 and all(sorted(m) == sorted(textworld.COMPASS) for m in textworld.SYMMETRIES)
    assert textworld.turned("North, then west. Northern", ["east", "south", "west", "north"]) == "East, then north. Northern"
    assert {textworld.turned("north", m) + textworld.turned("east", m) for m in textworld.SYMMETRIES} == {
        "northeast", "eastsouth", "southwest", "westnorth", "northwest", "westsouth", "southeast", "eastnorth"}
    play = {"messages": [{"role": "system", "content": "For example: go east."}, {"role": "user", "content": "An exit to the east."},
                         {"role": "assistant", "content": "go east"}]}
    assert [m["content"] for m in textworld.turned_play(play, textworld.SYMMETRIES[1])["messages"]] == [
        "For example: go east.", "An exit to the south.", "go south"]  # the system prompt is the one the agent reads


def test_train_py_plays_textworld_and_resumes_to_the_same_next_step(tmp_path):
    """train.py on TextWorld games (prepare_data.py's, a warm start on the walkthroughs, PPO), and
    a run stopped after its first step and resumed takes the same second step as one that went on."""
    data = tmp_path / "data"
    subprocess.run([sys.executable, "prepare_data.py", "--task=textworld", f"--out={data}", "--train-size=4", "--val-size=2"],
                   cwd=ROOT, check=True, capture_output=True, timeout=600)
    walkthroughs = [json.loads(line)["text"] for line in open(data / "walkthroughs.jsonl")]  # every game's in the 8 symmetries
    assert len(walkthroughs) == 4 * 8 and walkthroughs[:8] == [textworld.turned(walkthroughs[0], m) for m in textworld.SYMMETRIES]
    assert len(open(data / "transcripts.jsonl").readlines()) == 4 * textworld.PLAYS * 8
    common = ["--config=tiny", "data.task=textworld", f"data.train_path={data / 'train.parquet'}", f"data.val_path={data / 'val.parquet'}",
              "data.max_prompt_tokens=1536", "rollout.max_context_tokens=3072", "rollout.max_turns=4", "rollout.max_new_tokens=16",
              "rollout.max_obs_tokens=256", "rollout.prompts_per_step=2", "rollout.group_size=2", "ppo.mini_batch_size=4",
              "train.warm_start_steps=4", "train.warm_start_batch_size=2", "algo=ppo",
              "train.entropy_coef=0.01", "train.kl_mode=reward", "eval.every=0"]

    def run(run_dir, *overrides):
        cmd = [sys.executable, "train.py", *common, f"run_dir={run_dir}", *overrides]
        proc = procs.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        return proc.stdout, [json.loads(line) for line in open(run_dir / "metrics.jsonl") if '"time/step"' in line]

    with ThreadPoolExecutor(max_workers=2) as pool:  # side by side on 2 cores
        runs = [(tmp_path / "a", "steps=2"), (tmp_path / "b", "steps=1")]
        (first, straight), _ = pool.map(lambda a: run(*a), runs)
    # the warm start's own batch, not ppo.mini_batch_size's 4
    assert "warm start    4/4 | nll" in first and "| 2 demonstrations" in first
    out, resumed = run(tmp_path / "b", "steps=2")
    assert "resumed from" in out and "warm start" not in out
    [expected], [step2] = [m for m in straight if m["step"] == 2], [m for m in resumed if m["step"] == 2]
    for k in ["reward", "step_reward", "won", "score", "moves", "turns", "response_tokens", "pg_loss", "vf_loss", "grad_norm", "entropy"]:
        assert step2[k] == pytest.approx(expected[k], rel=1e-5, abs=1e-7), k
    assert expected["turns"] > 1 and expected["entropy"] != 0 and expected["finish/env_error"] == 0


def test_a_partial_rollout_ends_when_enough_groups_have_and_the_rest_go_on_first(engine, tok):
    """
    partial.rollout_step over the real engine, rollout.max_staleness=1: step 0 ends once its share of
    groups has ended, while the extra groups' environments still hold their steps (a closed gate); those
    pause and go on first in step 1, which starts no spare groups for them and waits for their end (paused
    again, their step-0 tokens would be 2 steps old when step 2 trains), then trains them, its share; its
    own groups, ended beyond the share, are held for step 2, which trains them at once.
    """
    cfg = make_config("tiny", ["rollout.prompts_per_step=2", "rollout.group_size=2", "ppo.mini_batch_size=4",
                               "rollout.max_staleness=1", "rollout.extra_prompts=2", "train.tis=true"])
    opened, held = threading.Event(), threading.Event()
    opened.set()
    row = lambda i, gate: {"id": f"r{i}", "start": i, "gate": gate, "answers": []}  # noqa: E731
    rollouts = Rollouts(engine, ChatEnv(Gated, tok, max_obs_tokens=256), SAMPLED, max_turns=2,
                        max_context_tokens=MAX_CONTEXT)
    spares = iter([row(10, held), row(11, held)])
    scored = []
    starts = lambda groups: [g[0].sample["start"] for g in groups]  # noqa: E731
    done, paused, counts = rollout_step(rollouts, [], [row(0, opened), row(1, opened)], spares, 0, 7,
                                        scored.append, lambda group: True, cfg, world=1)
    assert starts(done) == [0, 1] and starts(paused) == [10, 11]
    assert counts == {"groups_ended": 2, "groups_kept": 2, "carried_in": 0, "paused": 2, "held": 0,
                      "refills": 0}
    assert scored == [t for g in done for t in g]
    assert all(t.versions and set(t.versions) == {0} for t in scored)
    assert not rollouts.generating and all(t.finish_reason is None for g in paused for t in g)
    timer = threading.Timer(1.0, held.set)  # the held steps come back while step 1 runs
    timer.start()
    done, paused, counts = rollout_step(rollouts, paused, [row(2, opened), row(3, opened)], spares, 1, 8,
                                        scored.append, lambda group: True, cfg, world=1)
    timer.join()
    assert starts(done) == [10, 11] and starts(paused) == [2, 3]
    assert all(t.finish_reason for g in paused for t in g)
    assert counts == {"groups_ended": 4, "groups_kept": 2, "carried_in": 2, "paused": 0, "held": 2,
                      "refills": 0}
    held = paused
    done, paused, counts = rollout_step(rollouts, held, [row(4, opened), row(5, opened)], spares, 2, 9,
                                        scored.append, lambda group: True, cfg, world=1)
    assert starts(done) == [2, 3] and starts(paused) == [4, 5] and counts["carried_in"] == 2
    assert len(scored) == 12  # a held group is not scored again
    for g in held:
        for t in g:
            mask = torch.tensor(t.action_mask, dtype=torch.bool)
            assert set(torch.tensor(t.versions)[mask].tolist()) == {1}


@pytest.mark.parametrize("max_refill, kept, refills", [(1.0, 2, 3), (2.0, 3, 4)])
def test_dynamic_sampling_replaces_groups_that_train_nothing_within_the_step(engine, tok, max_refill, kept,
                                                                             refills):
    """
    grpo.refill: a group that ends with nothing to train on (here: an even start, by a scripted rule)
    is replaced at once by a group of the next spare prompt, until the step's share of groups that train
    is in (3 of 3), or grpo.max_refill x the share of spare prompts were started (2 of 3). Which spares are
    drawn does not depend on which group ended first.
    """
    cfg = make_config("tiny", ["rollout.prompts_per_step=3", "rollout.group_size=2", "grpo.refill=true",
                               f"grpo.max_refill={max_refill}", "ppo.mini_batch_size=6"])
    rows_ = {r["start"]: r for r in rows(8)}
    env = ChatEnv(lambda: Counter(turns=1), tok, max_obs_tokens=256)
    rollouts = Rollouts(engine, env, SAMPLED, max_turns=1, max_context_tokens=MAX_CONTEXT)
    spares = iter([rows_[4], rows_[6], rows_[5], rows_[7]])
    done, paused, counts = rollout_step(rollouts, [], [rows_[0], rows_[1], rows_[2]], spares, 0, 7,
                                        lambda t: None, lambda group: group[0].sample["start"] % 2 == 1, cfg,
                                        world=1)
    assert [g[0].sample["start"] for g in done] == [0, 1, 2, 4, 6, 5, 7][:3 + refills] and paused == []
    assert counts == {"groups_ended": 3 + refills, "groups_kept": kept, "carried_in": 0, "paused": 0,
                      "held": 0, "refills": refills}
