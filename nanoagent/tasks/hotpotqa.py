"""
HotpotQA, the flagship task: multi-hop questions answered by searching a Wikipedia corpus.

One prompt row per question: `id`, `question`, `messages` (system + user), `answers` (gold
answers), `type` and `level` (HotpotQA's: bridge/comparison, easy/medium/hard), and `evidence`
(the titles of the passages that hold the answer, in HotpotQA's supporting-fact order; used to
measure retrieval, never shown to the agent). The prompt holds messages only: the `search` tool's
schema is rendered into the system turn by the chat template at rollout time (env.ChatEnv), so the
same file serves any model and any tool description.

prepare() reads HotpotQA from the hub through the datasets library, or from a folder with the
original JSON files (hotpot_train_v1.1.json, hotpot_dev_distractor_v1.json or
hotpot_dev_fullwiki_v1.json), which is what tests use, and writes data.train_path / data.val_path
(train.parquet sampled from HotpotQA's train split, val.parquet from its dev split). The passages
come from the BeIR HotpotQA corpus, indexed by build_index.py into task.index_dir. The synthetic
task (synthetic.py) reuses this task's prompt, tools and scoring.
"""

import json
import os
import random
from dataclasses import dataclass

from nanoagent.data import load_prompts, write_prompts
from nanoagent.keys import opt
from nanoagent.reward import score_trajectory
from nanoagent.tools import make_tools

SYSTEM_PROMPT = (
    "Answer the user's question. The answer needs facts you must look up: call the `search` tool, as many "
    "times as you need, to find passages about the entities in the question, and search again with what you "
    "learn. You may think inside <think></think> before acting. When you know the answer, reply with only "
    "the answer, a few words, inside <answer></answer>, for example <answer>Paris</answer>."
)

QUESTION = "Question: {}"


@dataclass
class Knobs:
    index_dir: str = opt("data/hotpotqa/index", "search index from build_index.py")
    search_top_k: int = opt(3, "passages returned by one search call", low=1)


demonstration = None
HUB_QUESTIONS = ("hotpotqa/hotpot_qa", "distractor")
LOCAL_FILES = {"train": ["hotpot_train_v1.1.json"],
               "val": ["hotpot_dev_distractor_v1.json", "hotpot_dev_fullwiki_v1.json"]}


def qa_row(id, question, answers, type, level, evidence, system_prompt=SYSTEM_PROMPT):
    """A prompt row (messages as a list; write_prompts stores them as JSON text)."""
    return {"id": id, "question": question, "answers": list(answers), "type": type, "level": level,
            "evidence": list(evidence),
            "messages": [{"role": "system", "content": system_prompt},
                         {"role": "user", "content": QUESTION.format(question)}]}


def _evidence_titles(supporting_facts):
    """Titles of the supporting facts, first occurrence order: local JSON has [[title, sent_id], ...],
    the hub has {"title": [...], "sent_id": [...]}."""
    titles = (supporting_facts["title"] if isinstance(supporting_facts, dict)
              else [f[0] for f in supporting_facts])
    return list(dict.fromkeys(titles))


def hotpotqa_row(record):
    """A prompt row from one HotpotQA record (local JSON: `_id`; hub: `id`)."""
    return qa_row(record.get("_id", record.get("id")), record["question"], [record["answer"]], record["type"],
                  record["level"], _evidence_titles(record["supporting_facts"]))


def load_hotpotqa(split, source=None):
    """
    HotpotQA records of one split ("train" or "val") as dicts: from `source`, a folder with the
    original JSON files, or (source None) from the hub (distractor config; the questions are the
    same in fullwiki, and our agent searches the whole corpus either way).
    """
    if source is None:
        # here, not at the top: importing datasets takes seconds, and only this path needs it
        from datasets import load_dataset
        ds = load_dataset(*HUB_QUESTIONS, split="train" if split == "train" else "validation")
        return list(ds.remove_columns("context"))  # the passages come from the search index
    if not os.path.isdir(source):
        raise FileNotFoundError(f"HotpotQA source {source!r} is not a folder; pass the folder that holds "
                                f"{' and '.join(n[0] for n in LOCAL_FILES.values())}, "
                                "or leave --source out to use the hub")
    names = [n for n in LOCAL_FILES[split] if os.path.exists(os.path.join(source, n))]
    if not names:
        raise FileNotFoundError(f"{source} has no HotpotQA {split} file; "
                                f"expected one of: {', '.join(LOCAL_FILES[split])}")
    path = os.path.join(source, names[0])
    with open(path) as f:
        try:
            records = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON ({e}); "
                             "expected HotpotQA's list of question records") from None
    needed = ("_id", "question", "answer", "type", "level", "supporting_facts")
    for i, r in enumerate(records if isinstance(records, list) else [None]):
        missing = [k for k in needed if not isinstance(r, dict) or k not in r]
        if missing:
            raise ValueError(f"{path}: record {i} lacks {', '.join(missing)}; expected HotpotQA's format "
                             f"(a list of {{{', '.join(needed)}, context}})")
    return records


def sample(rows, size, seed, label):
    """`size` rows drawn without replacement, in their original order (size 0: all). Seeded by
    (seed, label), so train and val draws are independent and reproducible."""
    if not size or size >= len(rows):
        return list(rows)
    keep = sorted(random.Random(f"{label}-{seed}").sample(range(len(rows)), size))
    return [rows[i] for i in keep]


def tools(cfg):
    """Search over the index build_index.py wrote into task.index_dir."""
    return make_tools(["search"], cfg.task.index_dir, top_k=cfg.task.search_top_k)


def prompts(cfg, split):
    return load_prompts(cfg.data.train_path if split == "train" else cfg.data.val_path,
                        bad_prompts=cfg.data.bad_prompts)


def score(traj, cfg):
    return score_trajectory(traj, cfg.reward)


def prepare(out, train_size=0, val_size=None, seed=0, source=None):
    """OUT/train.parquet and OUT/val.parquet: `train_size` questions sampled from HotpotQA's train
    split (0: all), `val_size` (default 500) from its dev split; `source`: a folder of the original
    JSON files instead of the hub."""
    train = sample([hotpotqa_row(r) for r in load_hotpotqa("train", source)], train_size, seed, "train")
    val = sample([hotpotqa_row(r) for r in load_hotpotqa("val", source)],
                 500 if val_size is None else val_size, seed, "val")
    write_prompts(out, {"train": train, "val": val})
