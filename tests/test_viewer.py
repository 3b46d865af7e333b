"""
The trajectory viewer (nanoagent/viewer.py, report.py), from trajectories.jsonl as train.py writes it:
the real record builder (metrics.sampled_trajectories) and writer (common.StepLines) on a real step's
StepData, with GRPO's advantages and the trainer's logprobs of a real forward. Two groups are the
arithmetic task's scripted turns through the real calculator environment (tool calls, results,
rewards that vary), one the tiny model sampled by the transformers engine (its own finish reason,
engine logprobs to compare with the trainer's). The page is opened offline in headless Chromium
(Debian's chromium and chromium-driver, driven by selenium): what it lists, a filter, one trajectory's
turns, a trained token's colour, and no JavaScript error.
"""

import json
import re
import shutil

import pytest
import torch
from transformers import AutoTokenizer

import report
import train
from nanoagent.agent import run_agent, scripted_trajectories, token_texts
from nanoagent.batch import step_batch
from nanoagent.common import StepLines
from nanoagent.config import make_config
from nanoagent.engine import HFEngine, SamplingConfig, pad_token_id, stop_token_ids
from nanoagent.env import tool_env
from nanoagent.metrics import sampled_trajectories
from nanoagent.model import build_policy, read_weights, training_config
from nanoagent.tasks import arithmetic
from nanoagent.tools import calculator_tool
from nanoagent.viewer import chosen_steps
from test_report import step, write_run

CPU = torch.device("cpu")
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
INJECTED = "</script><script>throw new Error('the data ended the script')</script>"


def scripts(row):
    """A group's four scripted replies to an arithmetic row: the calculator then the right product (reward
    1), a guess (0), the calculator then a wrong product (0), a wrong guess with words before it (0)."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"{row['a']} * {row['b']}"}})
    product = row["a"] * row["b"]
    return [[f"<tool_call>\n{call}\n</tool_call>", f"<answer>{product}</answer>"],
            [f"<answer>{row['a'] + row['b']}</answer>"],
            [f"<tool_call>\n{call}\n</tool_call>", f"<answer>{product + 1}</answer>"],
            [f"I think it is <answer>{product - 1}</answer>"]]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir, process_group):
    """A run folder as train.py leaves it after one step: config.json, metrics.jsonl and the step's three
    groups in trajectories.jsonl. The first prompt carries a "</script>" (what a tool result could hold)."""
    folder = tmp_path_factory.mktemp("viewer") / "run"
    # the sampled group trains, its diff compared
    cfg = make_config("tiny", ["grpo.drop_uniform_groups=false"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    env = tool_env([calculator_tool()], tok)
    rows = arithmetic.make_prompts(3, 0, "train")
    rows[0]["messages"][1]["content"] += " " + INJECTED
    scripted = scripted_trajectories(env, [r for r in rows[:2] for _ in range(4)],
                                     [s for r in rows[:2] for s in scripts(r)])
    engine = HFEngine(tiny_model_dir, stop_token_ids(tok), pad_token_id(tok), "float32", seed=0)
    sampled = run_agent(engine, env, [rows[2]] * 4, SamplingConfig(max_new_tokens=3), max_turns=1,
                        max_context_tokens=cfg.rollout.max_context_tokens, seed=0)
    trajs = scripted + sampled
    for t in trajs:
        arithmetic.score(t, cfg)
    data = step_batch(trajs, pad_token_id(tok), cfg)
    policy = build_policy(
        training_config(tiny_model_dir), read_weights(tiny_model_dir), CPU, torch.float32, False
    )
    data.batch["old_logprobs"], data.batch["nucleus_logprobs"], _ = train.logprobs_before_update(
        policy, None, data, False, cfg, CPU)
    data.batch["advantages"] = train.critic_free_advantages(data, data.rewards, cfg)
    write_run(folder, cfg, [step(1)])
    StepLines(str(folder / "trajectories.jsonl"), None).write(sampled_trajectories(data, 0, tok, 3))
    env.close()
    return folder


def records(run):
    return [json.loads(line) for line in open(run / "trajectories.jsonl")]


def test_a_step_keeps_its_groups_token_by_token(run):
    kept = records(run)
    assert [(r["group"], r["member"]) for r in kept] == [(g, m) for g in range(3) for m in range(4)]
    assert all(r["step"] == 1 and r["trained"] for r in kept)
    first = kept[0]
    assert first["reward"] == 1.0 and first["turns"] == 2 and first["tool_calls"][0]["name"] == "calculator"
    for r in kept:
        assert (
            [len(a) for a in r["advantages"]]
            == [len(t) for t in r["turn_tokens"]]
            == [e - s for s, e in r["turn_spans"]]
        )
        assert "prompt_ids" not in r and "rollout_logprobs" not in r
    # GRPO: (1 - 0.25) / std of [1, 0, 0, 0] on every action token of the right answer, the others below 0
    assert all(a == pytest.approx(1.5, abs=1e-4) for turn in first["advantages"] for a in turn)
    assert all(a < 0 for r in kept[1:4] for turn in r["advantages"] for a in turn)
    # the tokens the engine sampled: the trainer's logprobs are the engine's (fp32, the same weights)
    assert all(abs(d) < 1e-3 for r in kept[8:] for turn in r["logprob_diff"] for d in turn)


def test_token_texts_join_into_the_text_of_the_ids(tiny_model_dir):
    """The tiny byte-level BPE splits "ï", "😀" and "世" into bytes: each token's text joins into the
    decoded text, a character the last of its tokens."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.encode("naïve 😀 世界 <tool_call>x</tool_call><|im_end|>", add_special_tokens=False)
    texts = token_texts(tok, ids)
    assert len(texts) == len(ids) and "".join(texts) == tok.decode(ids, skip_special_tokens=False)
    assert "😀" in texts and "世" in texts and "\ufffd" not in "".join(texts)


def test_report_reads_what_it_is_given_or_says_why_not(run, tmp_path, capsys):
    kept = (run / "trajectories.jsonl").read_text()
    cut = tmp_path / "cut.jsonl"
    cut.write_text(kept + kept.splitlines()[0][:100])  # a last line a kill cut short: left out
    assert report.main([f"--trajectories={cut}"]) == 0 and (tmp_path / "cut.html").exists()
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{\n" + kept)
    assert report.main([f"--trajectories={broken}"]) == 2
    assert "broken.jsonl:1: not a JSON line" in capsys.readouterr().err
    assert report.main([f"--trajectories={run / 'trajectories.jsonl'}", "--steps=1,4"]) == 2
    assert "no trajectories of step 4 were kept; steps kept: 1" in capsys.readouterr().err
    assert chosen_steps([{"step": s} for s in range(1, 11)]) == [1, 6, 10]
    assert chosen_steps([{"step": 3}]) == [3]


def browser(tmp_path):
    """Headless Chromium under chromedriver, offline: a fresh profile, no background connections, the
    console's messages kept; None without Chromium."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return None
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        return None
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1000",
                 f"--user-data-dir={tmp_path / 'profile'}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def rgba(css):
    return [float(x) for x in re.findall(r"[\d.]+", css)]


def test_the_viewer_opens_offline_in_a_browser_and_shows_what_the_agent_did(run, tmp_path):
    assert report.main([f"--run={run}"]) == 0
    assert "[trajectories.html](trajectories.html)" in (run / "report.md").read_text()
    page = run / "trajectories.html"
    assert "http://" not in page.read_text() and "https://" not in page.read_text()  # nothing to fetch
    driver = browser(tmp_path)
    if driver is None:
        pytest.skip("no Chromium here (Debian's chromium and chromium-driver, and selenium): "
                    "the viewer's browser test needs it")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    try:
        driver.get(page.as_uri())
        kept = records(run)
        listed = lambda: driver.find_elements(By.CSS_SELECTOR, "#list tbody tr")  # noqa: E731
        assert len(listed()) == len(kept) == 12
        assert driver.find_element(By.ID, "count").text == "12 of 12 trajectories"
        # filters: a reward of at least 0.5 (the two right answers), then a finish reason
        # (the sampled group's)
        driver.find_element(By.ID, "reward-min").send_keys("0.5")
        assert len(listed()) == sum(r["reward"] >= 0.5 for r in kept) == 2
        driver.find_element(By.ID, "reward-min").clear()
        reason = kept[8]["finish_reason"]
        Select(driver.find_element(By.ID, "finish")).select_by_value(reason)
        assert len(listed()) == sum(r["finish_reason"] == reason for r in kept) < 12
        Select(driver.find_element(By.ID, "finish")).select_by_value("")
        assert len(listed()) == 12

        # the first trajectory as a chat: the prompt, the tool call, its result, the answer, the reward
        listed()[0].click()
        messages = driver.find_elements(By.CSS_SELECTOR, "#chat .msg")
        roles = [m.find_element(By.CLASS_NAME, "role").get_attribute("textContent") for m in messages]
        assert roles == ["system", "user", "assistant · turn 1", "tool", "assistant · turn 2", "outcome"]
        assert INJECTED in messages[1].get_attribute("textContent")  # shown as text, the script not ended
        call = kept[0]["tool_calls"][0]
        assert messages[2].find_element(By.CLASS_NAME, "call").text.startswith("→ calculator")
        assert messages[3].find_element(By.CLASS_NAME, "text").text == call["result"]
        assert "reward 1" in messages[4].find_element(By.CLASS_NAME, "reward").text
        # a trained token's background is its advantage: red above 0 (here), blue below (its group's others)
        token = messages[2].find_element(By.CSS_SELECTOR, ".tok.trained")
        red, green, blue, alpha = rgba(token.value_of_css_property("background-color"))
        assert red > blue and alpha > 0.5 and token.get_attribute("title").startswith("advantage +1.5000")
        listed()[1].click()
        token = driver.find_element(By.CSS_SELECTOR, "#chat .tok.trained")
        red, green, blue, alpha = rgba(token.value_of_css_property("background-color"))
        assert blue > red and alpha > 0
        # the group side by side: its 4 members, the selected one marked
        members = driver.find_elements(By.CSS_SELECTOR, "#group .member")
        assert len(members) == 4 and "selected" in members[1].get_attribute("class")
        # a token the engine sampled: the trainer's logprob minus the engine's in its tooltip
        listed()[8].click()
        title = driver.find_element(By.CSS_SELECTOR, "#chat .tok.trained").get_attribute("title")
        assert abs(float(title.split("logprob diff (trainer - engine) ")[1])) < 1e-3, title
        driver.save_screenshot(str(tmp_path / "trajectories.png"))
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        driver.quit()
