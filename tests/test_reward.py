"""Answer normalisation, EM / substring EM / F1 edge cases, the format check and the reward recipe."""

import pytest

from nanoagent.agent import Trajectory
from nanoagent.config import make_config
from nanoagent.reward import (answer_scores, exact_match, extract_answer, f1_score, format_score, normalize_answer,
                              score_trajectory, substring_match, tags_well_formed)
from nanoagent.tools import ToolCall

PROMPT = [{"role": "system", "content": "Search, then answer."}, {"role": "user", "content": "Question: Where was Ada born?"}]


@pytest.mark.parametrize("text, normal", [
    ("The Eiffel Tower!", "eiffel tower"),
    ("  a   cat, an owl and THE dog.", "cat owl and dog"),
    ("Théâtre du Châtelet", "théâtre du châtelet"),        # accents are kept (SQuAD)
    ("Ｐａｒｉｓ", "paris"),                                  # full-width letters: NFKC
    ("“Quoted” — dash… «guillemets»", "quoted dash guillemets"),  # Unicode punctuation
    ("U.S.A.", "usa"),
    ("anthem theater", "anthem theater"),                   # articles only as whole words
    ("", ""),
])
def test_normalize_answer(text, normal):
    assert normalize_answer(text) == normal


def test_exact_substring_and_f1():
    golds = ["Ada Quill", "A. Quill"]
    assert exact_match("ada quill.", golds) == 1.0 and exact_match("Ada", golds) == 0.0
    assert substring_match("It was Ada Quill, the engineer", golds) == 1.0 and substring_match("Quill", ["Ada Quill"]) == 0.0
    assert f1_score("Ada Quill", golds) == 1.0
    assert f1_score("Ada Lovelace", ["Ada Quill"]) == pytest.approx(0.5)  # precision 1/2, recall 1/2
    assert f1_score("the Ada", ["Ada Quill"]) == pytest.approx(2 / 3)   # "the" is dropped: precision 1, recall 1/2
    assert f1_score("1802", ["1802"]) == 1.0 and exact_match("1,802", ["1802"]) == 1.0  # punctuation removed, not spaced
    assert answer_scores("Ada Quill", ["ada quill"]) == {"em": 1.0, "substring_em": 1.0, "f1": 1.0}


def test_empty_answers_never_score():
    assert answer_scores(None, ["Paris"]) == {"em": 0.0, "substring_em": 0.0, "f1": 0.0}
    for empty in ["", "   ", "the", "!!", "a an the"]:
        assert answer_scores(empty, ["Paris"]) == {"em": 0.0, "substring_em": 0.0, "f1": 0.0}, empty
    # a gold answer that normalises to nothing matches nothing (not even an empty prediction)
    assert answer_scores("", ["The"]) == {"em": 0.0, "substring_em": 0.0, "f1": 0.0}
    assert answer_scores("Paris", ["The", "Paris"])["em"] == 1.0
    assert answer_scores("Paris", [])["em"] == 0.0


def test_extract_answer_takes_the_last_one():
    assert extract_answer("<think>maybe <answer>x</answer>?</think> <answer> Paris </answer>") == "Paris"
    assert extract_answer("<answer>multi\nline</answer>") == "multi\nline"
    assert extract_answer("no tags") is None and extract_answer("<answer>open only") is None


def test_tags_well_formed():
    assert tags_well_formed("<think>a</think><tool_call>{}</tool_call>")
    assert tags_well_formed("plain text") and tags_well_formed("<think>x</think>\n<answer>y</answer>")
    for bad in ["<think>a", "a</think>", "<think><answer>x</answer></think>", "<answer>x</think>", "<think>a</think></answer>"]:
        assert not tags_well_formed(bad), bad


def trajectory(turns, calls=(), finish="done", answers=("Lisbon",)):
    """A trajectory as run_agent leaves it: assistant turns (and tool turns) after the prompt."""
    t = Trajectory(sample={"id": "q", "messages": PROMPT, "answers": list(answers)}, prompt_ids=[1], messages=list(PROMPT))
    for k, text in enumerate(turns):
        t.messages.append({"role": "assistant", "content": text})
        if k < len(turns) - 1:
            t.messages.append({"role": "tool", "content": "Doc 1 (Title: Ada) Ada was born in Lisbon."})
        t.turn_spans.append((k, k + 1))
    t.tool_calls, t.final_text, t.finish_reason = list(calls), turns[-1], finish
    return t


SEARCH = '<tool_call>\n{"name": "search", "arguments": {"query": "Ada"}}\n</tool_call>'


@pytest.mark.parametrize("turns, calls, finish, ok", [
    ([SEARCH, "<answer>Lisbon</answer>"], [ToolCall("search", {"query": "Ada"})], "done", 1.0),
    (["<think>look up</think>" + SEARCH, "<think>found</think><answer>Lisbon</answer>"], [ToolCall("search", {"query": "Ada"})], "done", 1.0),
    (["<answer>Lisbon</answer>"], [], "done", 1.0),
    ([SEARCH, "<answer>Lisbon</answer>"], [ToolCall(None, None, "Error: malformed tool call", True)], "done", 0.0),
    ([SEARCH, "<answer>Lisbon</answer>"], [ToolCall("weather", {}, "Error: unknown tool", True)], "done", 0.0),
    (["<answer>Porto</answer>" + SEARCH, "<answer>Lisbon</answer>"], [ToolCall("search", {"query": "Ada"})], "done", 0.0),
    (["<answer>Lisbon</answer><answer>Porto</answer>"], [], "done", 0.0),
    (["<answer></answer>"], [], "done", 0.0),
    (["Lisbon"], [], "done", 0.0),
    (["<think>unclosed <answer>Lisbon</answer>"], [], "done", 0.0),
    ([SEARCH, SEARCH], [ToolCall("search", {"query": "Ada"})] * 2, "max_turns", 0.0),
    (["<answer>Lisb"], [], "truncated", 0.0),
])
def test_format_score(turns, calls, finish, ok):
    assert format_score(trajectory(turns, calls, finish)) == ok


def test_require_think():
    plain = trajectory([SEARCH, "<answer>Lisbon</answer>"], [ToolCall("search", {"query": "Ada"})])
    thought = trajectory(["<think>a</think>" + SEARCH, " <think>b</think><answer>Lisbon</answer>"], [ToolCall("search", {"query": "Ada"})])
    assert format_score(plain, require_think=True) == 0.0 and format_score(thought, require_think=True) == 1.0


def test_recipe_weights_and_metric():
    wrong_but_close = trajectory(["<answer>Lisbon, Portugal</answer>"])
    score_trajectory(wrong_but_close)  # default: strict EM
    assert wrong_but_close.reward == 0.0
    assert wrong_but_close.scores == {"em": 0.0, "substring_em": 1.0, "f1": pytest.approx(2 / 3), "format": 1.0}
    recipe = make_config(overrides=["reward.metric=substring_em", "reward.format_weight=0.1"]).reward
    assert score_trajectory(wrong_but_close, recipe) == pytest.approx(1.1)
    recipe = make_config(overrides=["reward.metric=f1", "reward.answer_weight=2", "reward.format_weight=0.5"]).reward
    assert score_trajectory(wrong_but_close, recipe) == pytest.approx(2 * 2 / 3 + 0.5)
    malformed = trajectory(["<answer>Lisbon</answer><answer>Lisbon</answer>"])
    assert score_trajectory(malformed, recipe) == pytest.approx(2.0)  # the answer counts, the format bonus does not
    with pytest.raises(ValueError, match="reward.metric='acc' is not a valid choice; valid: em, substring_em, f1"):
        make_config(overrides=["reward.metric=acc"])
