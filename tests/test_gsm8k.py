"""The GSM8K task: its prompts from GSM8K's JSONL files (no hub), prepare_data.py, Agent-R1's reward on
hand-built trajectories, and demonstrations that turn a solution's annotations into calculator calls."""

import json

import pytest

import prepare_data
from nanoagent.agent import Trajectory, scripted_trajectories
from nanoagent.config import make_config
from nanoagent.data import load_prompts
from nanoagent.tasks import gsm8k, load_task
from nanoagent.tasks.gsm8k import SYSTEM_PROMPT, demonstration, gsm8k_row, load_gsm8k, same_number, score
from nanoagent.env import tool_env
from nanoagent.tools import ToolRunner, calculator_tool, parse_tool_calls

# Problems in GSM8K's format: the solution's <<expression=value>> annotations, then "#### answer".
TRAIN = [
    {"question": "Mia picked 48 apples on Monday and half as many on Tuesday. How many apples did she pick?",
     "answer": "On Tuesday she picked 48/2 = <<48/2=24>>24 apples.\nShe picked 48+24 = <<48+24=72>>72 apples.\n#### 72"},
    {"question": "A shop sells 12 boxes of 100 pens. How many pens does it sell?",
     "answer": "It sells 12*100 = <<12*100=1200>>1,200 pens.\n#### 1,200"},
    {"question": "Tom has 5 plums and eats all of them. How many plums are left?", "answer": "He ate them all, none are left.\n#### 0"},
    {"question": "It was 3 degrees and the temperature fell by 8 degrees. How warm is it now?",
     "answer": "It is 3-8 = <<3-8=-5>>-5 degrees.\n#### -5"},
]
TEST = [
    {"question": "Ann reads 15 pages a day. How many pages does she read in a week?", "answer": "She reads 15*7 = <<15*7=105>>105 pages.\n#### 105"},
    {"question": "A 2,400 dollar bill is shared by 3 people. How much does each pay?",
     "answer": "Each pays 2400/3 = $<<2400/3=800>>800.\n#### 800"},
    {"question": "Leo saves 250 dollars a month. How much does he save in 4 months?",
     "answer": "He saves 250*4 = $<<250*4=1000>>1,000.\n#### 1,000"},
]


@pytest.fixture
def gsm8k_dir(tmp_path):
    src = tmp_path / "gsm8k"
    src.mkdir()
    (src / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRAIN))
    (src / "test.jsonl").write_text(json.dumps(TEST[0]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in TEST[1:]))  # a blank line is skipped
    return src


def test_rows_from_the_jsonl_files(gsm8k_dir):
    train, val = load_gsm8k("train", str(gsm8k_dir)), load_gsm8k("val", str(gsm8k_dir))
    assert [r["id"] for r in train] == ["train-0", "train-1", "train-2", "train-3"] and [r["id"] for r in val] == ["test-0", "test-1", "test-2"]
    assert [r["answers"] for r in train] == [["72"], ["1200"], ["0"], ["-5"]]  # the number after ####, commas removed
    assert [r["answers"] for r in val] == [["105"], ["800"], ["1000"]]
    for row, record in zip(train + val, TRAIN + TEST):
        assert row["question"] == record["question"] and row["solution"] == record["answer"]
        assert row["messages"] == [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": record["question"]}]


def test_bad_sources_are_named(gsm8k_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="'.*nowhere' is not a folder"):
        load_gsm8k("train", str(tmp_path / "nowhere"))
    (gsm8k_dir / "test.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="has no test.jsonl; expected GSM8K's train.jsonl and test.jsonl"):
        load_gsm8k("val", str(gsm8k_dir))
    good = json.dumps(TRAIN[0]) + "\n"
    for line, error in [("{not json", r"train.jsonl:3: not JSON"),
                        (json.dumps({"question": "q?"}), r"train.jsonl:3: expected a JSON object with string fields question and answer"),
                        (json.dumps(["q?", "#### 1"]), r"train.jsonl:3: expected a JSON object"),
                        (json.dumps({"question": "q?", "answer": "It is 4."}), r"train.jsonl:3: the answer has no '#### <number>' line"),
                        (json.dumps({"question": "q?", "answer": "#### four"}), r"train.jsonl:3: the final answer 'four' after #### is not a number")]:
        (gsm8k_dir / "train.jsonl").write_text(good + "\n" + line + "\n" + good)
        with pytest.raises(ValueError, match=error):
            load_gsm8k("train", str(gsm8k_dir))


def test_prepare_writes_prompt_files_that_load_back(gsm8k_dir, tmp_path):
    for out, seed in (("a", 1), ("b", 1), ("c", 2)):
        (tmp_path / out).mkdir()
        gsm8k.prepare(str(tmp_path / out), train_size=2, val_size=2, seed=seed, source=str(gsm8k_dir))
    train, val = load_prompts(str(tmp_path / "a" / "train.parquet")), load_prompts(str(tmp_path / "a" / "val.parquet"))
    assert len(train) == 2 and len(val) == 2 and all(r["id"].startswith("test-") for r in val)  # val from GSM8K's test split
    rows = {r["id"]: r for r in load_gsm8k("train", str(gsm8k_dir)) + load_gsm8k("val", str(gsm8k_dir))}
    assert all(r == rows[r["id"]] for r in train + val)  # every field survives the parquet round trip
    for name in ("train.parquet", "val.parquet"):  # the same seed writes the same bytes
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert {r["id"] for r in train} != {r["id"] for r in load_prompts(str(tmp_path / "c" / "train.parquet"))}
    (tmp_path / "d").mkdir()
    gsm8k.prepare(str(tmp_path / "d"), source=str(gsm8k_dir))  # defaults: every problem of both splits, in file order
    cfg = make_config(overrides=["data.task=gsm8k", f"data.train_path={tmp_path / 'd' / 'train.parquet'}",
                                 f"data.val_path={tmp_path / 'd' / 'val.parquet'}"])
    assert [r["id"] for r in gsm8k.prompts(cfg, "train")] == ["train-0", "train-1", "train-2", "train-3"]
    assert [r["id"] for r in gsm8k.prompts(cfg, "val")] == ["test-0", "test-1", "test-2"]


def test_prepare_data_script(gsm8k_dir, tmp_path):
    assert prepare_data.main(["--task=gsm8k", f"--source={gsm8k_dir}", f"--out={tmp_path / 'out'}", "--train-size=3"]) == 0
    assert len(load_prompts(str(tmp_path / "out" / "train.parquet"))) == 3
    assert [r["answers"] for r in load_prompts(str(tmp_path / "out" / "val.parquet"))] == [["105"], ["800"], ["1000"]]
    with pytest.raises(SystemExit, match="prepare_data.py: GSM8K source .*nowhere' is not a folder"):
        prepare_data.main(["--task=gsm8k", f"--source={tmp_path / 'nowhere'}", f"--out={tmp_path / 'o'}"])
    (gsm8k_dir / "test.jsonl").write_text(json.dumps(TEST[0]) + "\n" + json.dumps({"question": "q?", "answer": "#### ?"}) + "\n")
    with pytest.raises(SystemExit, match=r"test.jsonl:2: the final answer '\?' after #### is not a number"):
        prepare_data.main(["--task=gsm8k", f"--source={gsm8k_dir}", f"--out={tmp_path / 'o'}"])


PROMPT = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": TRAIN[0]["question"]}]


def call(expression):
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "\n</tool_call>"


def trajectory(turns, finish="done", gold="72"):
    """A trajectory as the agent loop leaves it: the calls of every turn run by the calculator
    (errors included), the results of every turn but the last read by the model."""
    runner = ToolRunner([calculator_tool()])
    t = Trajectory(sample={"id": "q", "messages": PROMPT, "answers": [gold]}, prompt_ids=[1], messages=list(PROMPT))
    for k, text in enumerate(turns):
        calls = runner.run(parse_tool_calls(text))
        for c in calls:
            c.turn = k
        t.tool_calls += calls
        t.messages.append({"role": "assistant", "content": text})
        if k < len(turns) - 1:
            t.messages += [{"role": "tool", "content": c.result} for c in calls]
    t.final_text, t.finish_reason = turns[-1], finish
    return t


@pytest.mark.parametrize("turns, finish, require_think, accuracy, fmt, reward", [
    ([call("48+24"), "<answer>72</answer>"], "done", False, 1.0, 1.0, 1.0),            # right, in format
    ([call("48+24"), "<answer>71</answer>"], "done", False, 0.0, 1.0, 0.0),            # wrong, in format
    ([call("48+24"), "<answer></answer>"], "done", False, 0.0, 1.0, 0.0),              # empty: no better than wrong
    (["<think>add</think>\n" + call("48+24"), "<think>so</think> <answer>72</answer>\n"], "done", True, 1.0, 1.0, 1.0),
    (["<answer>72</answer>"], "done", False, 1.0, 0.5, -0.5),                         # right, but no tool call
    ([call("48+/24"), "<answer>72</answer>"], "done", False, 1.0, 0.5, -0.5),          # the call failed
    (["I add. " + call("48+24"), "<answer>72</answer>"], "done", False, 1.0, 0.5, -0.5),  # text outside the tags
    ([call("48") + call("24"), "<answer>72</answer>"], "done", False, 1.0, 0.5, -0.5),  # two calls in one turn
    ([call("48+24"), "It is 72."], "done", False, 0.0, 0.5, -0.5),                     # no <answer>
    ([call("48+24"), "<answer>72</answer>"], "truncated", False, 0.0, 0.5, -0.5),        # cut by the budget: no answer
    ([call("48+24"), call("72")], "max_turns", False, 0.0, 0.5, -0.5),                   # never answered
    ([call("48/2"), call("48+24"), "<answer>72</answer>"], "done", False, 1.0, 1.0, 1.0),  # capped at 1
    ([call("48/2"), call("48+24"), call("72")], "max_turns", False, 0.0, 1.0, 0.0),      # two good calls reach the cap
    ([call("48/2"), call("48+24"), "So <answer>72</answer>."], "done", False, 1.0, 1.0, 1.0),  # the cap forgives the last turn
    ([call("48+24"), "<answer>72</answer>"], "done", True, 1.0, 0.0, -1.0),            # no <think> where it is required
    (["<think>add</think>" + call("48+24"), "<answer>72</answer>"], "done", True, 1.0, 0.5, -0.5),
    (["The answer is 72"], "done", False, 0.0, 0.0, -1.0),
])
def test_agent_r1_reward(turns, finish, require_think, accuracy, fmt, reward):
    t = trajectory(turns, finish)
    cfg = make_config(overrides=["data.task=gsm8k", f"reward.require_think={require_think}"])
    assert score(t, cfg) == reward and t.reward == reward
    assert t.scores == {"accuracy": accuracy, "format": fmt}


@pytest.mark.parametrize("prediction, gold, same", [
    ("72", "72", True), ("72.0", "72", True), ("$72", "72", True), ("72 dollars", "72", True), ("72.", "72", True),
    ("1,200", "1200", True), ("1200", "1200", True), ("$1,200.00", "1200", True), ("0.50", "0.5", True),
    ("-5 degrees", "-5", True), ("3 bags of 24, so 72 in all", "72", True), ("72 or 73", "72", False),
    ("72.5", "72", False), ("7", "72", False), ("720", "72", False), ("10-15", "-15", False), ("no idea", "72", False),
])
def test_answers_compare_as_numbers(prediction, gold, same):
    assert same_number(prediction, gold) == same
    t = trajectory([call("1+1"), f"<answer>{prediction}</answer>"], gold=gold)
    assert score(t, make_config(overrides=["data.task=gsm8k"])) == float(same)


def test_demonstration_calls_the_calculator_on_each_annotation():
    row = gsm8k_row({"question": "q?", "answer": "Half: <<48/2=24>>24 and <<2^3=8>>8, <<$5*2=10>>$10, <<1,000*2=2000>>2,000, "
                                                "<<5/0=0>>0.\nIn all <<48+24=72>>72.\n#### 72"}, "train", 0, "here")
    cfg = make_config(overrides=["data.task=gsm8k"])
    turns = demonstration(row, None, cfg)
    assert turns == [call("48/2"), call("48+24"), "<answer>72</answer>"]  # the annotations the calculator refuses are left out
    calls = [c for t in turns[:-1] for c in parse_tool_calls(t)]
    ToolRunner([calculator_tool()]).run(calls)
    assert [(c.result, c.error) for c in calls] == [("24", False), ("72", False)]  # what the annotations say
    plain = gsm8k_row(TRAIN[2], "train", 2, "here")
    assert demonstration(plain, None, cfg) == ["<answer>0</answer>"]  # no annotations: answered directly


def test_demonstrations_run_in_the_environment_and_earn_the_reward(gsm8k_dir):
    """Scripted through the same trajectory assembly as RL (chat template, real calculator), every
    demonstration is a trajectory the environment accepts, and scores Agent-R1's reward: 1 where the
    solution has a calculation, -0.5 where it answers without a tool call."""
    from nanoagent.tiny import build_tokenizer  # here: it imports torch and transformers, which only this test needs
    task = load_task("gsm8k")
    rows = load_gsm8k("train", str(gsm8k_dir)) + load_gsm8k("val", str(gsm8k_dir))
    env = tool_env(task.tools(None), build_tokenizer())
    cfg = make_config(overrides=["data.task=gsm8k"])
    trajs = scripted_trajectories(env, rows, [task.demonstration(r, None, cfg) for r in rows])
    assert [task.score(t, cfg) for t in trajs] == [1.0, 1.0, -0.5, 1.0, 1.0, 1.0, 1.0]
    assert all(t.finish_reason == "done" and not any(c.error for c in t.tool_calls) for t in trajs)
    assert [c.result for c in trajs[0].tool_calls] == ["24", "72"] and [c.result for c in trajs[1].tool_calls] == ["1200"]
