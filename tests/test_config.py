"""Config: presets, dotted overrides, refusals that name the key, round trip through config.json."""

import ast
import json
import math
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import procs
from nanoagent.config import (Config, ConfigError, all_keys, from_dict, make_config, reference, save_config,
                              to_dict)
from nanoagent.keys import fixed_keys
from nanoagent.presets import PRESETS
from nanoagent.update import get_lr


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
    ("nosuch=1", r"unknown config key 'nosuch'. --help lists every key.$"),
    ("rollout=3", "unknown config key 'rollout'"),
    ("algo=dpo", "algo='dpo' is not a valid choice; valid: ppo, grpo, rloo, reinforce, reinforce_plus_plus"),
    ("train.loss_agg=sum", "valid: token_mean, seq_mean_token_mean, step_mean_token_mean"),
    ("steps=two", "steps='two': expected int"),
    ("steps=1.5", "steps='1.5': expected int"),
    ("train.lr=fast", "train.lr='fast': expected float"),
    ("train.tis=maybe", "train.tis='maybe': expected a bool"),
    ("rollout.group_size=1", "algo=grpo needs rollout.group_size >= 2"),
    ("train.kl_mode=reward", "algo=grpo with train.kl_mode=reward: its advantage compares outcomes"),
    ("data.bad_prompts=skip", "valid: refuse, drop"),
    ("ppo.credit=turn", "valid: token, step"),
    ("ppo.credit=step", "ppo.credit=step needs algo=ppo"),
    ("ppo.ratio=sequence",
     "ppo.ratio=sequence with train.loss_agg=token_mean: GSPO's objective .* "
     "Use train.loss_agg=seq_mean_token_mean"),
    ("rollout.context=last_3", "valid: full, last_k"),
    ("steps", "expected key=value"),
])
def test_bad_overrides_are_refused_with_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        make_config("tiny", [override])


@pytest.mark.parametrize("override, message", [
    ("rollout.tool_timeout_s=-5", r"rollout.tool_timeout_s=-5.0: must be > 0"),
    ("rollout.tool_timeout_s=nan", r"rollout.tool_timeout_s=nan: must be a finite number"),
    ("rollout.max_obs_tokens=0", r"rollout.max_obs_tokens=0: must be >= 1"),
    ("train.lr=inf", r"train.lr=inf: must be a finite number"),
    ("train.kl_coef=nan", r"train.kl_coef=nan: must be a finite number"),
    ("rollout.tensor_parallel_size=0", r"rollout.tensor_parallel_size=0: must be >= 1"),
    ("rollout.keep_turns=0", r"rollout.keep_turns=0: must be >= 1"),
    ("rollout.top_p=1.5", r"rollout.top_p=1.5: must be in \(0, 1\]"),
    ("ppo.gamma=1.01", r"ppo.gamma=1.01: must be in \[0, 1\]"),
    ("seed=4294967296", r"seed=4294967296: must be in \[0, 2147483647\]"),
])
def test_out_of_range_values_are_refused_with_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        make_config("tiny", [override])


def test_a_context_per_turn_needs_step_level_credit_with_ppo():
    with pytest.raises(ConfigError, match="rollout.context=last_k with algo=ppo needs ppo.credit=step"):
        make_config("tiny", ["algo=ppo", "rollout.context=last_k"])
    assert make_config("tiny", ["algo=ppo", "rollout.context=last_k", "ppo.credit=step"]).rollout.context == "last_k"
    assert make_config("tiny", ["rollout.context=last_k"]).algo == "grpo"  # GRPO: every turn shares the trajectory's advantage


def test_every_number_has_a_range_and_every_float_is_finite():
    """A numeric key added later gets a range too: -1 is refused for every one of them but the two
    whose negative values mean something, and nan/inf for every float."""
    signed = {"train.entropy_coef", "train.tool_call_reward"}  # an entropy penalty, a cost per tool call
    for key, k in all_keys(make_config("tiny")).items():
        typ = k.type
        if typ in (int, float) and key not in signed:
            with pytest.raises(ConfigError, match=re.escape(f"{key}=-1")):
                make_config("tiny", [f"{key}=-1"])
        for bad in ("nan", "inf", "-inf") if typ is float else ():
            with pytest.raises(ConfigError, match=re.escape(f"{key}={bad}: must be a finite number")):
                make_config("tiny", [f"{key}={bad}"])
    make_config("tiny", ["train.entropy_coef=-0.01", "train.tool_call_reward=-0.1"])


def test_unknown_preset_lists_the_valid_ones():
    valid = ("valid: tiny, demo, demo-textworld, demo-smollm2-imitation, demo-smollm2, corridor, hotpotqa, "
             "hotpotqa-7b-lora")
    with pytest.raises(ConfigError, match=valid):
        make_config("huge")


def test_round_trip_through_json(tmp_path):
    cfg = make_config("tiny", ["algo=ppo", "seed=7", "train.entropy_coef=0.01", "log.wandb=true"])
    save_config(cfg, tmp_path / "config.json")
    again = from_dict(json.loads((tmp_path / "config.json").read_text()))
    assert to_dict(again) == to_dict(cfg)


def test_train_cli_prints_saves_and_refuses(tmp_path):
    commands = [["--help"], ["--config=tiny", "rollout.max_turn=4"], ["--config=tiny", "rollout.tensor_parallel_size=2"]]
    with ThreadPoolExecutor(max_workers=3) as pool:  # independent, and mostly imports: side by side
        out, bad, tp = pool.map(lambda args: procs.run([sys.executable, "train.py", *args], capture_output=True, text=True,
                                                       timeout=120), commands)
    assert out.returncode == 0 and "rollout.max_turns" in out.stdout and "tiny" in out.stdout
    assert bad.returncode == 2 and "rollout.max_turns" in bad.stderr
    assert tp.returncode == 2 and "train.py takes 1 only" in tp.stderr


def test_config_and_common_import_nothing_above_them():
    """keys.py and presets.py are the ground floor (they import no nanoagent module), common.py stands on
    keys.py alone (ConfigError) and config.py on the three at most (a task's task.* keys are read from
    its file, not imported): every script and module reads them, so an import from them reaches up
    into the whole kit (common -> tiny was an import circle, config -> tasks pulled the tasks into
    every config check). Every import in the file counts, one inside a function too."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    floor = [("nanoagent/common.py", {"nanoagent.keys"}),
             ("nanoagent/keys.py", set()),
             ("nanoagent/presets.py", set()),
             ("nanoagent/config.py", {"nanoagent.common", "nanoagent.keys", "nanoagent.presets"})]
    for path, allowed in floor:
        imported = set()
        for node in ast.walk(ast.parse(open(os.path.join(root, path)).read())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                package = "nanoagent" if node.level else node.module  # a relative import is one of nanoagent's
                imported |= {f"{package}.{alias.name}" for alias in node.names} if package == "nanoagent" else {package}
        assert {m for m in imported if m.split(".")[0] == "nanoagent"} <= allowed, path


@pytest.mark.parametrize("override, meant", [
    ("lr=1e-5", "train.lr"),  # a key without its group
    ("critic_lr=1e-5", "ppo.critic_lr"),
    ("train.max_turns=4", "rollout.max_turns"),  # in another group
    ("max_turn=4", "rollout.max_turns"),  # near a key's leaf name
])
def test_an_unknown_key_names_the_key_meant_and_no_wall_of_keys(override, meant):
    with pytest.raises(ConfigError) as refused:
        make_config("tiny", [override])
    key = override.split("=")[0]
    assert str(refused.value) == f"unknown config key {key!r}. Did you mean: {meant}? --help lists every key."


def test_help_lists_every_task_and_preset_there_is(capsys):
    """The help's lists are built from the tasks' folder and PRESETS, so a new task or preset is in them."""
    import train
    from nanoagent.config import task_names
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the option help
    assert "textworld" in task_names() and f"({', '.join(task_names())})" in all_keys()["data.task"].help
    assert f"--config CONFIG preset: {', '.join(PRESETS)} (default: none)" in out
    assert f"presets (--config=NAME): {', '.join(PRESETS)}" in out


def test_a_task_declares_its_own_keys_in_its_file(tmp_path):
    """A task with a knob is one file: its Knobs give the task.* keys, with their bounds and whether a
    resume may change them, read from the file without importing it (this one would not import); a
    task that wraps another can take the other's."""
    path = tmp_path / "my_task.py"
    path.write_text("import no_such_library\nfrom dataclasses import dataclass\n"
                    "from typing import Literal\n\n"
                    "from nanoagent.keys import opt\n\n\n@dataclass\nclass Knobs:\n"
                    "    depth: int = opt(3, 'how deep', low=1, fixed=True)\n"
                    "    mode: Literal['a', 'b'] = opt('a', 'which way')\n")
    cfg = make_config("tiny", ["task.depth=5", f"data.task={path}"])  # data.task is applied first
    assert (cfg.task.depth, cfg.task.mode) == (5, "a") and to_dict(cfg)["task"] == {"depth": 5, "mode": "a"}
    assert from_dict(to_dict(cfg)).task.depth == 5
    assert {"task.depth", "data.task", "algo"} <= fixed_keys(cfg) and "task.mode" not in fixed_keys(cfg)
    for override, refusal in [("task.depth=0", "task.depth=0: must be >= 1"),
                              ("task.mode=c", "task.mode='c' is not a valid choice; valid: a, b"),
                              ("task.num_train=8",
                               f"unknown config key 'task.num_train' of data.task={path}.")]:
        with pytest.raises(ConfigError, match=re.escape(refusal)):
            make_config("tiny", [f"data.task={path}", override])
    assert make_config("tiny").task.num_val == 32  # the tiny preset's arithmetic: its own keys
    reference_text = reference()
    assert "data.task=arithmetic:" in reference_text and "task.num_train" in reference_text
    # a task that wraps another takes its keys
    wrapper, importer = tmp_path / "wrapper.py", tmp_path / "importer.py"
    wrapper.write_text("from nanoagent.tasks import arithmetic\n\nKnobs = arithmetic.Knobs\n")
    importer.write_text("from nanoagent.tasks.hotpotqa import Knobs, score\n")
    assert make_config("tiny", [f"data.task={wrapper}", "task.num_train=9"]).task.num_train == 9
    assert make_config("tiny", [f"data.task={importer}", "task.search_top_k=2"]).task.search_top_k == 2
    # a preset's task.* values go on with a task file that declares them too (demo-smollm2: top_k 1, not
    # hotpotqa's default 3), and not into one that does not; a default of the task before is not carried
    assert make_config("demo-smollm2", [f"data.task={importer}"]).task.search_top_k == 1
    assert make_config("demo-smollm2", [f"data.task={wrapper}"]).task.num_train == 2048
    assert make_config("hotpotqa", ["data.task=synthetic"]).task.index_dir == ""
    path.write_text("@dataclass\nclass Knobs:\n    depth: int = opt(default_depth(), 'how deep')\n")
    with pytest.raises(ConfigError, match="its Knobs may use only opt, Literal, dataclass and the builtins"):
        make_config("tiny", [f"data.task={path}"])


def test_learning_rate_schedules_warm_up_then_hold_or_come_down_towards_zero():
    """train.lr_schedule after train.warmup_steps: constant holds the rate; linear comes down by equal
    steps to base / (steps - warm-up) at the last step (TRL's linear schedule); cosine follows half a
    cosine from the rate towards 0, the same at the ends, above the line before the middle."""
    def rates(schedule):
        cfg = make_config("tiny", ["steps=6", "train.warmup_steps=2", f"train.lr_schedule={schedule}"])
        return [get_lr(step, 1.0, cfg) for step in range(cfg.steps)]
    assert rates("constant") == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert rates("linear") == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])
    cosine = rates("cosine")
    assert cosine[:3] == pytest.approx([0.5, 1.0, 1.0]) and cosine[4] == pytest.approx(0.5)
    assert cosine[3] == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert cosine[5] == pytest.approx(0.5 * (1 - math.cos(math.pi / 4)))
    assert make_config("tiny").train.lr_schedule == "constant"  # today's behaviour, the default
