"""Config: presets, dotted overrides, refusals that name the key, round trip through config.json."""

import json
import subprocess
import sys

import pytest

from nanoagent.config import PRESETS, Config, ConfigError, from_dict, make_config, save_config, to_dict


def test_defaults_presets_and_overrides():
    cfg = make_config()
    assert isinstance(cfg, Config) and cfg.algo == "grpo"
    tiny = make_config("tiny", ["algo=ppo", "rollout.max_turns=4", "train.lr=3e-5", "ppo.whiten_advantages=false"])
    assert tiny.model == "tiny" and tiny.data.task == "arithmetic"
    assert tiny.algo == "ppo" and tiny.rollout.max_turns == 4 and tiny.train.lr == 3e-5
    assert tiny.ppo.whiten_advantages is False and isinstance(tiny.rollout.max_turns, int)
    for name in PRESETS:
        make_config(name)  # every preset is valid as written


@pytest.mark.parametrize("override, message", [
    ("rollout.max_turn=4", "unknown config key 'rollout.max_turn'.* Did you mean: rollout.max_turns"),
    ("nosuch=1", "unknown config key 'nosuch'.*Valid keys: model, algo"),
    ("rollout=3", "unknown config key 'rollout'"),
    ("algo=dpo", "algo='dpo' is not a valid choice; valid: ppo, grpo"),
    ("train.loss_agg=sum", "valid: token_mean, seq_mean"),
    ("steps=two", "steps='two': expected int"),
    ("steps=1.5", "steps='1.5': expected int"),
    ("train.lr=fast", "train.lr='fast': expected float"),
    ("train.tis=maybe", "train.tis='maybe': expected a bool"),
    ("rollout.group_size=1", "algo=grpo needs rollout.group_size >= 2"),
    ("train.kl_mode=reward", "algo=grpo with train.kl_mode=reward: GRPO divides each group's scores by their std"),
    ("data.bad_prompts=skip", "valid: refuse, drop"),
    ("steps", "expected key=value"),
])
def test_bad_overrides_are_refused_with_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        make_config("tiny", [override])


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="valid: tiny, demo, hotpotqa"):
        make_config("huge")


def test_round_trip_through_json(tmp_path):
    cfg = make_config("tiny", ["algo=ppo", "seed=7", "train.entropy_coef=0.01", "log.wandb=true"])
    save_config(cfg, tmp_path / "config.json")
    again = from_dict(json.loads((tmp_path / "config.json").read_text()))
    assert to_dict(again) == to_dict(cfg)


def test_train_cli_prints_saves_and_refuses(tmp_path):
    out = subprocess.run([sys.executable, "train.py", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "rollout.max_turns" in out.stdout and "tiny" in out.stdout
    bad = subprocess.run([sys.executable, "train.py", "--config=tiny", "rollout.max_turn=4"], capture_output=True, text=True)
    assert bad.returncode == 2 and "rollout.max_turns" in bad.stderr
    tp = subprocess.run([sys.executable, "train.py", "--config=tiny", "rollout.tensor_parallel_size=2"], capture_output=True, text=True)
    assert tp.returncode == 2 and "train.py takes 1 only" in tp.stderr
