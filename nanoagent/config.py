"""
Reading a config: the defaults (nanoagent/keys.py), a preset by name, then `key=value` overrides.

    torchrun ... train.py --config=tiny algo=ppo rollout.max_turns=4 train.lr=1e-5

Every override is checked against the declared keys: an unknown key, a value of the wrong type, a choice
that does not exist or a number out of bounds is refused with a message that names the key and what is
valid. Presets are just lists of overrides, so they go through the same checks.
"""

import dataclasses
import difflib
import json
import math
import os
import typing
from typing import Literal

from nanoagent.keys import Config, ConfigError, NoKnobs, all_keys, node_keys, task_knobs, task_names
from nanoagent.presets import PRESETS

# the algos whose advantage compares a trajectory's outcome with a baseline (rl.outcome_token_advantages), and
# those whose baseline is the trajectory's group (rollout.group_size >= 2)
OUTCOME_ALGOS = ("grpo", "rloo", "reinforce")
GROUP_ALGOS = ("grpo", "rloo", "reinforce_plus_plus_baseline")
# keys a task owns now that a run's saved config.json may hold under their old names
MOVED = {"data.num_train": "task.num_train", "data.num_val": "task.num_val",
         "data.index_dir": "task.index_dir", "rollout.search_top_k": "task.search_top_k"}


def _parse_value(key, text, typ):
    """Turn the command-line text of one override into a value of the field's type, or refuse."""
    if typing.get_origin(typ) is Literal:
        choices = typing.get_args(typ)
        if text not in choices:
            raise ConfigError(f"{key}={text!r} is not a valid choice; valid: {', '.join(choices)}")
        return text
    if typ is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={text!r}: expected a bool (true/false)")
    if typ in (int, float):
        try:
            return typ(text)
        except ValueError:
            raise ConfigError(f"{key}={text!r}: expected {typ.__name__}") from None
    if typ is str:
        return text
    raise ConfigError(f"{key}: fields of type {typ} cannot be set from the command line")


def set_key(cfg, key, text):
    """Apply one `dotted.key=value` override to cfg in place. A new data.task brings its task.* keys, at
    their defaults but for those the task before it had set (a preset's): a key the new task declares too,
    with a value of its type, goes on with that value (a preset's task.search_top_k=1 stays when a run
    swaps in a task file that wraps the preset's task)."""
    entry = all_keys(cfg).get(key)
    if entry is None:
        raise ConfigError(_unknown(key, cfg))
    value = _parse_value(key, text, entry.type)
    *groups, leaf = key.split(".")
    node = cfg
    for g in groups:
        node = getattr(node, g)
    if key == "data.task" and value != cfg.data.task:
        before, defaults, cfg.task = cfg.task, type(cfg.task)(), task_knobs(value)()
        for f in dataclasses.fields(cfg.task):
            set_before = getattr(before, f.name, None)
            if (set_before != getattr(defaults, f.name, None)
                    and isinstance(set_before, type(getattr(cfg.task, f.name)))):
                setattr(cfg.task, f.name, set_before)
    setattr(node, leaf, value)


def _unknown(key, cfg):
    """The refusal of an unknown key, with the keys it may have meant: those with its leaf name (lr:
    train.lr, a key given without its group or in another), else those close to it, whole or by leaf
    name. --help lists them all."""
    keys = list(all_keys(cfg))
    leaves = {}
    for k in keys:
        leaves.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    leaf = key.rsplit(".", 1)[-1]
    close = leaves.get(leaf) or list(dict.fromkeys([
        *difflib.get_close_matches(key, keys, n=3),
        *(k for near in difflib.get_close_matches(leaf, leaves, n=3) for k in leaves[near]),
    ]))[:3]
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    task = f" of data.task={cfg.data.task}" if key.startswith("task.") else ""
    return f"unknown config key {key!r}{task}.{hint} --help lists every key."


def apply_overrides(cfg, overrides):
    """Apply `key=value` overrides in order, data.task first (it decides which task.* keys exist), then
    validate."""
    pairs = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"expected key=value, got {item!r}")
        pairs.append((key.strip(), text.strip()))
    for key, text in sorted(pairs, key=lambda pair: pair[0] != "data.task"):
        set_key(cfg, key, text)
    validate(cfg)
    return cfg


def make_config(preset=None, overrides=()):
    """Defaults, then the preset's overrides, then the caller's (command line) overrides."""
    cfg = Config()
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
        apply_overrides(cfg, PRESETS[preset])
    return apply_overrides(cfg, overrides)


def within(k, value):
    """Whether a value is within a key's declared bounds."""
    return ((k.low is None or value >= k.low) and (k.above is None or value > k.above)
            and (k.high is None or value <= k.high))


def bounds(k):
    """A key's declared bounds as text ('>= 1', 'in (0, 1]'), or '' when it has none."""
    if k.high is not None:
        return f"in [{k.low}, {k.high}]" if k.low is not None else f"in ({k.above}, {k.high}]"
    return f">= {k.low}" if k.low is not None else f"> {k.above}" if k.above is not None else ""


def validate(cfg):
    """
    Every number within its declared bounds and every float finite (a nan or inf anywhere would poison
    the run where it is used, often many steps later), then the checks across keys; each message names
    the key, its value and what is valid.
    """
    values = flatten(to_dict(cfg))

    def need(ok, msg):
        if not ok:
            raise ConfigError(msg)

    for key, k in all_keys(cfg).items():
        value = values[key]
        need(k.type is not float or math.isfinite(value), f"{key}={value}: must be a finite number")
        need(k.type not in (int, float) or within(k, value), f"{key}={value}: must be {bounds(k)}")
    r = cfg.rollout
    need(r.step_timeout_s > r.tool_timeout_s, f"rollout.step_timeout_s={r.step_timeout_s}: must be > "
         f"rollout.tool_timeout_s ({r.tool_timeout_s}): a step runs its tool calls")
    need(cfg.algo not in GROUP_ALGOS or r.group_size >= 2,
         f"algo={cfg.algo} needs rollout.group_size >= 2 (got {r.group_size}): a group of one has no "
         "baseline")
    need(r.max_context_tokens > cfg.data.max_prompt_tokens,
         f"rollout.max_context_tokens ({r.max_context_tokens}) must exceed data.max_prompt_tokens "
         f"({cfg.data.max_prompt_tokens})")
    need(not (cfg.algo in OUTCOME_ALGOS and cfg.train.kl_mode == "reward"),
         f"algo={cfg.algo} with train.kl_mode=reward: its advantage compares outcomes, and a per-token KL "
         "penalty in the reward has no place in it (GRPO, dividing each group's scores by their std, would "
         "blow the penalty's noise up to advantages of order 1 in a group of equal outcomes); use "
         "train.kl_mode=loss (k3 in the loss, as GRPO does) or none")
    need(cfg.algo == "ppo" or cfg.ppo.credit == "token",
         f"ppo.credit=step needs algo=ppo: it is how GAE assigns the critic's values, and algo={cfg.algo} "
         "has no critic")
    need(cfg.ppo.whiten_over == "tokens"
         or (cfg.algo == "ppo" and cfg.ppo.credit == "step" and cfg.ppo.whiten_advantages),
         "ppo.whiten_over=steps whitens step-level GAE advantages: it needs algo=ppo, ppo.credit=step and "
         "ppo.whiten_advantages=true")
    need(not (cfg.algo == "ppo" and r.context != "full" and cfg.ppo.credit == "token"),
         f"rollout.context={r.context} with algo=ppo needs ppo.credit=step: a turn whose context leaves "
         "earlier turns out is a sequence of its own, and token-level GAE cannot carry a turn's value across "
         "to the next turn's sequence; step-level GAE links the turns")
    need(r.context != "summary" or r.summary_tokens < r.max_context_tokens,
         f"rollout.summary_tokens ({r.summary_tokens}) must be below rollout.max_context_tokens "
         f"({r.max_context_tokens}): the summary turn reads the context it summarises")
    need(cfg.ppo.ratio == "token" or cfg.train.loss_agg != "token_mean",
         f"ppo.ratio={cfg.ppo.ratio} with train.loss_agg=token_mean: GSPO's objective is a mean over "
         "sequences (or steps) of each one's clipped ratio times its advantage, every one weighed the same; "
         "a token mean weighs each by its length. Use train.loss_agg="
         f"{'step_mean_token_mean' if cfg.ppo.ratio == 'step' else 'seq_mean_token_mean'} "
         "(verl's fix for GSPO)")
    need(r.max_staleness == 0 or r.extra_prompts > 0,
         f"rollout.max_staleness={r.max_staleness} needs rollout.extra_prompts > 0: a step ends once "
         "rollout.prompts_per_step groups have ended, so without groups beyond them nothing is ever carried "
         "over")
    need(r.max_staleness == 0 or cfg.train.tis,
         f"rollout.max_staleness={r.max_staleness} needs train.tis=true: tokens sampled by an older policy "
         "are weighed by min(pi_old / pi_behaviour, train.tis_cap) (decoupled PPO, docs/formulation.md: "
         "Partial rollouts); without it their loss would treat them as the current policy's samples")
    need((r.prompts_per_step * r.group_size) % cfg.ppo.mini_batch_size == 0,
         f"rollout.prompts_per_step x rollout.group_size ({r.prompts_per_step * r.group_size}) "
         f"must be a multiple of ppo.mini_batch_size ({cfg.ppo.mini_batch_size})")


def to_dict(cfg):
    return dataclasses.asdict(cfg)


def from_dict(d):
    """Rebuild a Config from to_dict's output (e.g. a run's config.json), checking every key."""
    saved = saved_keys(d)
    overrides = [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in saved.items()]
    return apply_overrides(Config(), overrides)


def saved_keys(d):
    """A saved config dict -> {"group.key": value}, a key that moved since (MOVED) under its new name
    where the saved data.task has it, else left out (a task that never read it)."""
    flat = flatten(d)
    task_keys = node_keys(task_knobs(flat.get("data.task", Config().data.task))(), "task.")
    return {MOVED.get(k, k): v for k, v in flat.items() if MOVED.get(k, k) in task_keys or k not in MOVED}


def flatten(d, prefix=""):
    """A nested config dict -> {"group.key": value}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, prefix + k + "."))
        else:
            out[prefix + k] = v
    return out


def format_config(cfg):
    return "\n".join(f"{k} = {v}" for k, v in flatten(to_dict(cfg)).items())


def save_config(cfg, path):
    with open(path, "w") as f:
        json.dump(to_dict(cfg), f, indent=2)


def load_run_config(model, preset=None, overrides=()):
    """
    (config, where it came from) for a script that runs a trained model (rollout.py, chat.py): the
    named preset, else the config.json a training run saved next to its <run_dir>/hf export (the
    task, tools, budgets and sampling the model was trained with: the defaults would evaluate it
    under other ones, silently), else the defaults; then the command line's overrides.
    """
    if preset is not None:
        return make_config(preset, overrides), f"preset {preset}"
    run_config = os.path.join(os.path.dirname(os.path.normpath(model)), "config.json")
    if os.path.isdir(model) and os.path.isfile(run_config):
        with open(run_config) as f:
            try:
                saved = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{run_config}: not JSON ({e}); "
                                  "pass --config NAME to use a preset instead") from None
        # a nanoagent run's, not any config.json
        if isinstance(saved, dict) and "data" in saved and "rollout" in saved:
            try:
                cfg = from_dict(saved)
            except ConfigError as e:
                raise ConfigError(f"{run_config}: {e}") from None
            return apply_overrides(cfg, overrides), run_config
    return make_config(None, overrides), "defaults"


def _reference_line(key, k):
    kind = "|".join(typing.get_args(k.type)) if typing.get_origin(k.type) is Literal else k.type.__name__
    kind += f" {bounds(k)}" if bounds(k) else ""
    return f"  {key:<34} {kind:<22} {k.default!s:<28} {k.help}{' [fixed]' if k.fixed else ''}"


def reference():
    """The config reference as text: every key, its type and bounds, default and help (for --help), the
    task.* keys of each task in nanoagent/tasks/."""
    lines = ["config keys (key=value; [fixed]: a resume may not change it):"]
    lines += [_reference_line(key, k) for key, k in node_keys(Config(task=NoKnobs()), "").items()]
    for name in task_names():
        knobs = node_keys(task_knobs(name)(), "task.")
        if knobs:
            lines.append(f"data.task={name}:")
            lines += [_reference_line(key, k) for key, k in knobs.items()]
    return "\n".join(lines) + f"\npresets (--config=NAME): {', '.join(PRESETS)}"
