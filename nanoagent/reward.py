"""
Scoring trajectories. The agent answers inside <answer>...</answer>; we compare the normalised
answer with the gold answers three ways, so results compare with both Agent-R1 and Search-R1:
- exact match (strict EM): normalised strings equal (Search-R1's reward and metric);
- substring EM: a normalised gold answer occurs in the normalised prediction (Agent-R1's "accuracy");
- token F1 (SQuAD).
Normalisation is SQuAD's: lower case, punctuation deleted ("U.S.A." -> "usa", "1,802" -> "1802"),
no articles (a/an/the), single spaces, plus Unicode NFKC and deletion of Unicode punctuation too
(accents are kept, as in SQuAD). A prediction that
normalises to nothing scores 0 everywhere, and a gold answer that normalises to nothing is ignored:
an empty <answer></answer> must never be rewarded.

The format check asks for the shape the task's prompt asks for: the trajectory ended with an
answer, every assistant turn has balanced, unnested <think>/<answer>/<tool_call> tags, only the last
turn answers (exactly once, non-empty, without a tool call), and every tool call was well formed
and ran (a call the environment refused or that failed counts against it). With
reward.require_think every turn must also open with <think>...</think>.

The reward recipe (cfg.reward) is linear: answer_weight * the chosen answer metric +
format_weight * the format check. The default is strict EM alone.
"""

import re
import string
import unicodedata
from collections import Counter

from nanoagent.keys import RewardConfig

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
TAG_RE = re.compile(r"<(/?)(think|answer|tool_call)>")


def normalize_answer(text):
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(ch for ch in text
                   if not (unicodedata.category(ch).startswith("P") or ch in string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def extract_answer(text):
    """The content of the last <answer>...</answer> in the text, or None."""
    found = ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


def _golds(golds):
    return [g for g in (normalize_answer(x) for x in golds) if g]


def exact_match(prediction, golds):
    p = normalize_answer(prediction)
    return float(bool(p) and p in _golds(golds))


def substring_match(prediction, golds):
    p = normalize_answer(prediction)
    return float(bool(p) and any(g in p for g in _golds(golds)))


def f1_score(prediction, golds):
    p_tokens = normalize_answer(prediction).split()

    def f1(g_tokens):
        common = sum((Counter(p_tokens) & Counter(g_tokens)).values())
        if common == 0:
            return 0.0
        precision, recall = common / len(p_tokens), common / len(g_tokens)
        return 2 * precision * recall / (precision + recall)
    return max((f1(g.split()) for g in _golds(golds)), default=0.0)


def answer_scores(prediction, golds):
    """{"em", "substring_em", "f1"} for a prediction (None = no answer given: all zero)."""
    if prediction is None:
        return {"em": 0.0, "substring_em": 0.0, "f1": 0.0}
    return {"em": exact_match(prediction, golds), "substring_em": substring_match(prediction, golds),
            "f1": f1_score(prediction, golds)}


def tags_well_formed(text):
    """Every <think>, <answer> and <tool_call> is closed before another one opens, and nothing is
    closed that was not opened."""
    open_tag = None
    for m in TAG_RE.finditer(text):
        closing, name = m.group(1) == "/", m.group(2)
        if closing != (open_tag is not None) or (closing and name != open_tag):
            return False
        open_tag = None if closing else name
    return open_tag is None


def format_score(traj, require_think=False):
    """1.0 when the trajectory has the format the task asks for (module docstring), else 0.0."""
    turns = [m["content"] for m in traj.messages[len(traj.sample["messages"]):] if m["role"] == "assistant"]
    if traj.finish_reason != "done" or not turns or any(c.error for c in traj.tool_calls):
        return 0.0
    for k, text in enumerate(turns):
        if not tags_well_formed(text) or (require_think and not re.match(r"\s*<think>", text)):
            return 0.0
        answers = len(ANSWER_RE.findall(text))
        if k < len(turns) - 1 and answers:
            return 0.0
    last = turns[-1]
    return float(len(ANSWER_RE.findall(last)) == 1 and "<tool_call>" not in last
                 and bool(extract_answer(last)))


def score_trajectory(traj, recipe=None):
    """
    Set traj.scores (em, substring_em, f1 of the final <answer> against the sample's gold answers,
    and format) and traj.reward (the recipe's weighted sum; default: strict EM). Returns the reward.
    """
    recipe = recipe or RewardConfig()
    traj.scores = {**answer_scores(extract_answer(traj.final_text), traj.sample.get("answers", [])),
                   "format": format_score(traj, recipe.require_think)}
    traj.reward = (recipe.answer_weight * traj.scores[recipe.metric]
                   + recipe.format_weight * traj.scores["format"])
    return traj.reward
