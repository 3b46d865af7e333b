"""
Answer scoring. The agent answers inside <answer>...</answer>; we compare the normalised answer
with the gold answers three ways, so results compare with both Agent-R1 and Search-R1:
- exact match (strict EM): normalised strings equal;
- substring EM: a normalised gold answer occurs in the normalised prediction (Agent-R1's "accuracy");
- token F1 (SQuAD).
Normalisation is SQuAD's: lower case, no punctuation, no articles (a/an/the), single spaces,
plus Unicode NFKC and removal of Unicode punctuation.
"""

import re
import string
import unicodedata
from collections import Counter

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize_answer(text):
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(" " if unicodedata.category(ch).startswith("P") or ch in string.punctuation else ch for ch in text)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def extract_answer(text):
    """The content of the last <answer>...</answer> in the text, or None."""
    found = ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


def exact_match(prediction, golds):
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(g) for g in golds))


def substring_match(prediction, golds):
    p = normalize_answer(prediction)
    return float(any((g := normalize_answer(gold)) and g in p for gold in golds))


def f1_score(prediction, golds):
    def f1(p, g):
        p_tokens, g_tokens = normalize_answer(p).split(), normalize_answer(g).split()
        common = sum((Counter(p_tokens) & Counter(g_tokens)).values())
        if common == 0:
            return 0.0
        precision, recall = common / len(p_tokens), common / len(g_tokens)
        return 2 * precision * recall / (precision + recall)
    return max((f1(prediction, g) for g in golds), default=0.0)


def answer_scores(prediction, golds):
    """{"em", "substring_em", "f1"} for a prediction (None = no answer given: all zero)."""
    if prediction is None or not golds:
        return {"em": 0.0, "substring_em": 0.0, "f1": 0.0}
    return {"em": exact_match(prediction, golds), "substring_em": substring_match(prediction, golds), "f1": f1_score(prediction, golds)}


def score_trajectory(traj):
    """Set traj.scores (em, substring_em, f1 against the sample's gold answers) and traj.reward
    (strict EM of the final <answer>). The weighted task recipe builds on these scores."""
    traj.scores = answer_scores(extract_answer(traj.final_text), traj.sample.get("answers", []))
    traj.reward = traj.scores["em"]
    return traj.reward
