"""prepare_data.py and the tasks' prompts: HotpotQA from files in its original JSON format, the synthetic world, and the
check every prompt file gets when it is loaded."""

import json
import os
import random
import sys
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import procs
import prepare_data
from nanoagent.config import ConfigError, make_config
from nanoagent.data import load_prompts, row_problem, step_prompts, write_prompts
from nanoagent.tasks import hotpotqa, synthetic
from nanoagent.tasks.hotpotqa import SYSTEM_PROMPT, hotpotqa_row, load_hotpotqa
from nanoagent.tasks.synthetic import (demonstration, make_split,
                                       make_world, passages, questions, scrambled_dialogues, scrambled_world)
from nanoagent.tools import parse_tool_calls

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prepare(*args):
    proc = procs.run([sys.executable, os.path.join(ROOT, "prepare_data.py"), *map(str, args)], capture_output=True, text=True,
                     cwd=ROOT, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return proc


def hotpot_record(i, split):
    """A record in HotpotQA's original JSON format (hotpot_train_v1.1.json / hotpot_dev_*_v1.json)."""
    return {
        "_id": f"5a8b57f25542995d1e6f13{i:02d}{split[0]}",
        "question": f"Which magazine was started first, Arthur's Magazine {i} or First for Women {i}?",
        "answer": f"Arthur's Magazine {i}",
        "type": "comparison" if i % 2 else "bridge",
        "level": ["easy", "medium", "hard"][i % 3],
        "supporting_facts": [[f"Arthur's Magazine {i}", 0], [f"First for Women {i}", 0], [f"Arthur's Magazine {i}", 1]],
        "context": [[f"Arthur's Magazine {i}", ["Arthur's Magazine (1844-1846) was an American literary periodical.", " It was published in Philadelphia."]],
                    [f"First for Women {i}", ["First for Women is a woman's magazine published by Bauer Media Group in the USA."]]],
    }


@pytest.fixture
def hotpot_dir(tmp_path):
    src = tmp_path / "hotpot"
    src.mkdir()
    (src / "hotpot_train_v1.1.json").write_text(json.dumps([hotpot_record(i, "train") for i in range(12)]))
    (src / "hotpot_dev_distractor_v1.json").write_text(json.dumps([hotpot_record(i, "dev") for i in range(6)]))
    return src


def test_hotpotqa_from_local_json(hotpot_dir, tmp_path):
    proc = prepare("--task=hotpotqa", f"--source={hotpot_dir}", f"--out={tmp_path / 'a'}", "--train-size=5", "--val-size=3", "--seed=1")
    assert proc.returncode == 0, proc.stderr
    train, val = load_prompts(str(tmp_path / "a" / "train.parquet")), load_prompts(str(tmp_path / "a" / "val.parquet"))
    assert len(train) == 5 and len(val) == 3
    records = {r["_id"]: r for r in json.loads((hotpot_dir / "hotpot_train_v1.1.json").read_text())}
    for row in train:
        r = records[row["id"]]
        assert row["answers"] == [r["answer"]] and (row["type"], row["level"], row["question"]) == (r["type"], r["level"], r["question"])
        assert row["evidence"] == [r["supporting_facts"][0][0], r["supporting_facts"][1][0]]  # titles, first-seen order
        assert row["messages"] == [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"Question: {r['question']}"}]
    assert all(row["id"].endswith("d") for row in val)  # val comes from the dev file
    # the same seed writes the same bytes; another seed draws another sample
    assert prepare("--task=hotpotqa", f"--source={hotpot_dir}", f"--out={tmp_path / 'b'}", "--train-size=5", "--val-size=3", "--seed=1").returncode == 0
    assert prepare("--task=hotpotqa", f"--source={hotpot_dir}", f"--out={tmp_path / 'c'}", "--train-size=5", "--val-size=3", "--seed=2").returncode == 0
    for name in ("train.parquet", "val.parquet"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert [r["id"] for r in train] != [r["id"] for r in load_prompts(str(tmp_path / "c" / "train.parquet"))]
    # size 0 takes the whole split, in file order
    assert prepare("--task=hotpotqa", f"--source={hotpot_dir}", f"--out={tmp_path / 'd'}", "--val-size=100").returncode == 0
    assert [r["id"] for r in load_prompts(str(tmp_path / "d" / "train.parquet"))] == list(records)


def test_hotpotqa_hub_layout_rows():
    """The hub's records (id, supporting_facts as columns) give the same rows as the JSON files."""
    local = hotpot_record(3, "dev")
    hub = {**{k: v for k, v in local.items() if k not in ("_id", "supporting_facts")}, "id": local["_id"],
           "supporting_facts": {"title": [f[0] for f in local["supporting_facts"]], "sent_id": [f[1] for f in local["supporting_facts"]]}}
    assert hotpotqa_row(hub) == hotpotqa_row(local)


def test_hotpotqa_bad_sources_are_named(hotpot_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        load_hotpotqa("train", str(tmp_path / "missing"))
    (hotpot_dir / "hotpot_dev_distractor_v1.json").unlink()
    with pytest.raises(FileNotFoundError, match="no HotpotQA val file; expected one of: hotpot_dev_distractor_v1.json"):
        load_hotpotqa("val", str(hotpot_dir))
    (hotpot_dir / "hotpot_dev_fullwiki_v1.json").write_text(json.dumps([{"question": "q?"}]))
    with pytest.raises(ValueError, match="hotpot_dev_fullwiki_v1.json: record 0 lacks _id, answer, type, level, supporting_facts"):
        load_hotpotqa("val", str(hotpot_dir))
    (hotpot_dir / "hotpot_train_v1.1.json").write_text("{not json")
    with pytest.raises(ValueError, match="hotpot_train_v1.1.json is not JSON"):
        load_hotpotqa("train", str(hotpot_dir))
    proc = prepare("--task=hotpotqa", f"--source={tmp_path / 'nowhere'}", f"--out={tmp_path / 'o'}")
    assert proc.returncode != 0 and "nowhere' is not a folder" in proc.stderr


def test_synthetic_contract_and_determinism(tmp_path):
    for out, seed in (("a", 0), ("b", 0), ("c", 1)):
        proc = prepare("--task=synthetic", f"--out={tmp_path / out}", f"--seed={seed}", "--val-size=20")
        assert proc.returncode == 0, proc.stderr
    names = ["train.parquet", "val.parquet", "corpus.jsonl", "scrambled.jsonl", "dialogues.jsonl"]
    assert sorted(os.listdir(tmp_path / "a")) == sorted(names)
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes(), name
    corpus = [json.loads(line) for line in (tmp_path / "a" / "corpus.jsonl").read_text().splitlines()]
    assert len(corpus) == 200 + 40 + 50 + 10 and set(corpus[0]) == {"id", "title", "text"}  # the default world
    train, val = load_prompts(str(tmp_path / "a" / "train.parquet")), load_prompts(str(tmp_path / "a" / "val.parquet"))
    assert len(val) == 20 and {r["type"] for r in train} == {"1-hop", "2-hop"}
    assert not {r["evidence"][0] for r in val} & {r["evidence"][0] for r in train}  # split by the entity asked about
    assert len({r["id"] for r in train + val}) == len(train) + len(val)


def test_synthetic_prompts_and_index_are_made_on_the_spot_when_no_files_are_named(tmp_path):
    """data.train_path, data.val_path and task.index_dir empty: the rows prepare() writes, and a search over
    the world's passages (the packaged MiniLM) whose top passage for an entity's name is the entity's own."""
    proc = prepare("--task=synthetic", f"--out={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    cfg = make_config("demo-smollm2", ["task.search_top_k=1"])
    assert (cfg.data.train_path, cfg.data.val_path, cfg.task.index_dir) == ("", "", "")
    for split in ("train", "val"):
        assert synthetic.prompts(cfg, split) == load_prompts(str(tmp_path / f"{split}.parquet")), split
    [search] = synthetic.tools(cfg)
    titles = [p["title"] for p in passages(make_world())][::25]
    results = search.call_batch([{"query": " " + title} for title in titles])
    expected = [f"Doc 1 (Title: {title}" for title in titles]
    assert [r.split(") ", 1)[0] for r in results] == expected, results[:2]


def test_synthetic_answers_need_the_passages():
    world = make_world(seed=3, people=40, companies=10, cities=12, countries=4)
    text = {p["title"]: p["text"] for p in passages(world)}
    assert len(text) == 40 + 10 + 12 + 4  # every title is unique
    qs = questions(world)
    assert {q["type"] for q in qs} == {"1-hop", "2-hop"}
    for q in qs:
        *before, last = q["evidence"]
        assert q["answer"] in text[last] and q["subject"] in q["question"], q
        if before:  # 2-hop: the subject's passage names the bridge entity, not the answer
            assert last in text[before[0]] and q["answer"] not in text[before[0]].replace(q["subject"], ""), q


def test_scrambled_passages_keep_the_words_and_move_the_facts():
    world = make_world(seed=3, people=40, companies=10, cities=12, countries=4)
    real, scrambled = passages(world), passages(scrambled_world(world))
    assert [p["title"] for p in real] == [p["title"] for p in scrambled]  # every entity, in the same order
    words = lambda ps: sorted(w for p in ps for w in p["text"].split())  # noqa: E731
    assert words(real) == words(scrambled)  # the same words as often, in other places
    text = {p["title"]: p["text"] for p in real}
    kept = [p for p in scrambled if p["text"] == text[p["title"]]]
    assert not kept  # each entity's facts are another entity's
    facts = {q["question"]: q["answer"] for q in questions(world)}
    fake = passages(scrambled_world(world, seed=1))
    assert fake != scrambled and sum(f"{facts[f'Where was {p} born?']} in" in t["text"] for p in world["person"] for t in fake
                                      if t["title"] == p) < 10  # a birthplace stays true only where two people share it


def test_scrambled_dialogues_search_right_and_read_their_answer_from_the_result():
    """The pretraining conversations: every search names the passage it shows, the answer stands in the last
    result, and it is the scrambled world's answer, mostly not the real one (nothing true to memorise)."""
    world = make_world(seed=3, people=40, companies=10, cities=12, countries=4)
    real = {q["question"]: q["answer"] for q in questions(world)}
    dialogues = scrambled_dialogues(world, copies=3, per_copy=50)
    assert len(dialogues) == 150 and all(d["tools"][0]["function"]["name"] == "search" for d in dialogues)
    asked_in_both = true_answers = 0
    for d in dialogues:
        system, user, *turns = d["messages"]
        assert system["role"] == "system" and user["content"].startswith("Question: ")
        actions, results = turns[0::2], turns[1::2]
        assert [m["role"] for m in actions] == ["assistant"] * len(actions) and [m["role"] for m in results] == ["tool"] * len(results)
        assert len(actions) == len(results) + 1 in (2, 3)  # one search per hop, then the answer
        for action, result in zip(actions, results):
            [call] = parse_tool_calls(action["content"])
            assert result["content"].startswith(f"Doc 1 (Title:{call.arguments['query']}) ")
        answer = actions[-1]["content"].removeprefix("<answer> ").removesuffix("</answer>")
        assert answer in results[-1]["content"].split(") ", 1)[1]
        question = user["content"].removeprefix("Question: ")
        asked_in_both += question in real
        true_answers += answer == real.get(question)
    assert asked_in_both > len(dialogues) * 0.8 and true_answers < asked_in_both * 0.3, (asked_in_both, true_answers)


def test_synthetic_demonstration_is_well_formed():
    train, _, corpus = make_split(seed=0, val_size=10, people=40, companies=10, cities=12, countries=4)
    text = {p["title"]: p["text"] for p in corpus}
    # the defaults (skip 0.25, extra hop 0.0), then other rates
    for rates in ([], ["task.demo_skip_second_hop=0.0", "task.demo_extra_hop=0.25"]):
        cfg = make_config(overrides=["data.task=synthetic"] + rates)
        guess, skip, extra_hop = cfg.task.demo_guess, cfg.task.demo_skip_second_hop, cfg.task.demo_extra_hop
        rng = random.Random(0)
        kinds = Counter()
        for row in train:
            # the linked entity is the first name the subject's passage gives (each name has a passage)
            subject = text[row["evidence"][0]]
            named = sorted((subject.find(title), title) for title in text
                           if title != row["evidence"][0] and title in subject)
            assert named[0][1] == row["linked"]
            turns = demonstration(row, rng, cfg)
            queries = [c.arguments["query"] for t in turns[:-1] for c in parse_tool_calls(t)
                       if c.name == "search" and not c.error]
            assert len(queries) == len(turns) - 1 and turns[-1].startswith("<answer> ")
            if not queries:
                kinds["guess"] += 1
                assert turns == [f"<answer> {row['evidence'][0]}</answer>"]  # the name in the question
            elif len(queries) < len(row["evidence"]):
                kinds["one hop short"] += 1
                assert queries == [" " + row["evidence"][0]]
                assert turns[-1] == f"<answer> {row['evidence'][1]}</answer>"  # the bridge entity
            else:
                extra = len(queries) > len(row["evidence"])
                kinds["extra hop" if extra else "right"] += 1
                assert queries == [" " + t for t in row["evidence"] + [row["linked"]] * extra]
                assert turns[-1] == f"<answer> {row['answers'][0]}</answer>"
        one_hop, two_hop = (sum(len(r["evidence"]) == n for r in train) for n in (1, 2))
        assert abs(kinds["guess"] / len(train) - guess) < 0.05, kinds  # imperfect on purpose: RL has room
        assert abs(kinds["extra hop"] / (one_hop * (1 - guess)) - extra_hop) < 0.1, kinds
        assert kinds["right"] > 0, kinds
        assert (kinds["one hop short"] > 0) == (skip > 0), kinds
        assert kinds["one hop short"] <= two_hop * (1 - guess) * skip * 1.5, kinds


def test_prompts_fit_the_tiny_model(tiny_model_dir, tmp_path):
    """The synthetic prompts, with the search tool's schema rendered by the chat template, fit the tiny preset."""
    from transformers import AutoTokenizer
    from nanoagent.config import make_config
    from nanoagent.env import tool_env
    from nanoagent.tools import Tool, search_tool
    train, val, _ = make_split(seed=0, val_size=10)
    search = search_tool(retriever=None)
    assert isinstance(search, Tool)
    env = tool_env([search], AutoTokenizer.from_pretrained(tiny_model_dir))
    lengths = [len(env.prompt_ids(r["messages"])) for r in train[:50] + val]
    assert max(lengths) < make_config("tiny").data.max_prompt_tokens
    assert '"name": "search"' in env.render(train[0]["messages"], add_generation_prompt=True)


def test_prepare_refuses_what_a_task_cannot_do(tmp_path):
    proc = prepare("--task=arithmetic", f"--out={tmp_path / 'a'}")
    assert proc.returncode != 0 and "makes its prompts on the spot" in proc.stderr
    proc = prepare("--task=nosuch", f"--out={tmp_path / 'b'}")
    assert proc.returncode != 0 and "unknown task 'nosuch'; tasks: arithmetic, corridor, gsm8k, hotpotqa, openai_agent, synthetic" in proc.stderr
    proc = prepare("--task=synthetic", f"--out={tmp_path / 'c'}", f"--source={tmp_path}")
    assert proc.returncode != 0 and "takes no source" in proc.stderr


MESSAGES = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]


def test_bad_rows_are_refused_or_dropped_when_the_file_is_loaded(tmp_path, capsys):
    """Every kind of row a run cannot train on is found at load, not at the step that reaches it."""
    good = [{"id": "ok1", "messages": MESSAGES, "answers": ["a"]}, {"id": "ok2", "messages": MESSAGES, "answers": "Paris"},
            {"id": 7, "messages": MESSAGES}]
    bad = [{"id": "n42", "messages": MESSAGES, "answers": [42]}, {"id": "nnull", "messages": MESSAGES, "answers": [None]},
           {"id": "bare42", "messages": MESSAGES, "answers": 42}, {"id": "nomsg", "answers": []},
           {"id": "emptymsg", "messages": [], "answers": []}, {"id": "role", "messages": [{"role": "bot", "content": "q"}]},
           {"id": "content", "messages": [{"role": "user", "content": None}]}, {"messages": MESSAGES},
           {"id": "ok1", "messages": MESSAGES}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in good + bad) + '{"id": "cut", "messa\n')
    with pytest.raises(ValueError, match=r"p.jsonl: 10 of 13 prompts cannot be trained on \(first: n42 \(answers must be a list of strings, "
                                         r"got \[42\]\); nnull .*; bare42 \(answers must be a list of strings, got 42\)\); .*data.bad_prompts=drop"):
        load_prompts(str(path))
    kept = load_prompts(str(path), bad_prompts="drop")
    assert [r["id"] for r in kept] == ["ok1", "ok2", 7] and [r["answers"] for r in kept] == [["a"], ["Paris"], []]
    assert "dropped 10 of 13 prompts that cannot be trained on" in capsys.readouterr().out
    reasons = [row_problem(r, {"ok1"}) for r in bad[3:] + ["not a row"]]
    assert [r.split(",")[0].split(" (")[0] for r in reasons] == [
        "messages must be a non-empty list of {role", "messages must be a non-empty list of {role", "every message needs a role",
        "every message needs a role", "id must be a non-empty string or an integer", "duplicate id", "not a JSON object"]
    parquet = tmp_path / "p.parquet"  # a parquet column of numbers, as a script that wrote answers as ints would leave
    pq.write_table(pa.Table.from_pylist([{"id": "i", "messages": json.dumps(MESSAGES), "answers": [3]}]), parquet)
    with pytest.raises(ValueError, match=r"p.parquet: 1 of 1 prompts cannot be trained on \(first: i \(answers must be a list of strings"):
        load_prompts(str(parquet))
    with pytest.raises(ValueError, match="p.parquet: no prompts to train on"):
        load_prompts(str(parquet), bad_prompts="drop")


def test_empty_prompt_files_are_refused_with_their_path(tmp_path):
    """An empty train or val file stops the run when it is loaded, naming the file, instead of
    failing later (a division by zero at step 1, an IndexError at evaluation or export)."""
    pq.write_table(pa.Table.from_pylist([]), tmp_path / "val.parquet")  # what prepare_data.py used to write for an empty split
    (tmp_path / "train.jsonl").write_text("\n")
    cfg = make_config("tiny", ["data.task=hotpotqa", f"data.train_path={tmp_path / 'train.jsonl'}", f"data.val_path={tmp_path / 'val.parquet'}"])
    with pytest.raises(ValueError, match="train.jsonl' has no rows; write it again with prepare_data.py"):
        hotpotqa.prompts(cfg, "train")
    with pytest.raises(ValueError, match="val.parquet' has no rows"):
        hotpotqa.prompts(cfg, "val")


def test_prepare_refuses_an_empty_split(hotpot_dir, tmp_path):
    (hotpot_dir / "hotpot_dev_distractor_v1.json").write_text("[]")
    # a folder that was there stays (one prepare_data.py made goes: test_newcomer.py)
    (tmp_path / "out").mkdir()
    with pytest.raises(SystemExit, match="the val split has no prompts; nothing written to"):
        prepare_data.main(["--task=hotpotqa", f"--source={hotpot_dir}", f"--out={tmp_path / 'out'}"])
    assert os.listdir(tmp_path / "out") == []  # no train file either: a split is checked before anything is written
    with pytest.raises(ValueError, match=r"the train split: 1 of 1 prompts cannot be trained on \(first: q \(answers must be a list of strings"):
        write_prompts(str(tmp_path), {"train": [{"id": "q", "messages": MESSAGES, "answers": [1.5]}]})


def test_balanced_steps_hold_each_type_in_equal_numbers_and_the_plain_order_is_unchanged():
    """data.balance_by=type: every step's prompts take the types in turn (4 + 4 of 8, on each rank),
    each type's rows all seen once per its own epoch; without it the order is the plain shuffle."""
    rows = [{"id": i, "type": "1-hop" if i % 3 else "2-hop"} for i in range(30)]  # 20 of one, 10 of the other
    for step in range(6):
        for rank in range(2):
            prompts = step_prompts(rows, step, 4, rank, 2, seed=7, shuffle=True, balance_by="type")
            assert [p["type"] for p in prompts] == ["1-hop", "2-hop"] * 2
    seen = [p["id"] for step in range(5) for p in step_prompts(rows, step, 4, 0, 1, 7, True, "type")]
    assert sorted(i for i in seen if i % 3 == 0) == list(range(0, 30, 3))  # 2-hop's epoch: each once
    assert len(set(seen)) == len(seen)
    assert step_prompts(rows, 3, 4, 0, 1, 7, True, "type") == step_prompts(rows, 3, 4, 0, 1, 7, True, "type")
    plain = [p["id"] for p in step_prompts(rows, 0, 30, 0, 1, 7, True)]
    assert plain == np.random.default_rng([7, 0]).permutation(30).tolist()
    with pytest.raises(
        ConfigError, match="data.balance_by=kind: 30 of 30 training prompts have no 'kind' field"
    ):
        step_prompts(rows, 0, 4, 0, 1, 7, True, "kind")
