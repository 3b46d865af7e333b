"""
Tasks. A task is one module, in this folder or anywhere else, that says everything task-specific
about training an agent on it; train.py, rollout.py, chat.py and prepare_data.py find it by name
(`data.task=hotpotqa`, a file here) or by path (`data.task=path/to/my_task.py`) and know nothing
else about it. A task module defines:

    SYSTEM_PROMPT              the system turn its prompts carry (chat.py starts conversations with it)
    QUESTION                   how a user's question is worded in its prompts, e.g. "Question: {}"
    tools(cfg)                 -> [Tool]: the tools the agent may call (nanoagent/tools.py); or, for a
                                  task that is not tool calls (a game, a simulator, a shell),
    environment(cfg)           -> a function that makes one environment per trajectory: an object with
                                  reset(row) and step(action) (nanoagent/env.py says what they return)
    prompts(cfg, split)        -> rows for split "train" or "val": dicts with "id", "messages"
                                  (system + user, chat format) and "answers"; made on the spot or
                                  read from the files prepare() wrote (nanoagent/data.py: load_prompts)
    score(traj, cfg)           -> sets traj.reward (a float) and traj.scores (a dict of floats to log)
    demonstration              None, or (row, rng) -> [assistant turn texts]: a scripted solution
                                  to imitate before RL (train.warm_start_steps)
    Knobs                      optional: a dataclass of the task's own config keys (task.*), each
                                  declared with nanoagent.keys.opt (arithmetic.py has two)
    prepare(out, train_size, val_size, seed, source)
                               None (prompts made on the spot), or writes OUT/train.parquet and
                               OUT/val.parquet (and anything else the task reads, e.g. a corpus)

Copy the task closest to yours (arithmetic.py: prompts made on the spot, one tool; hotpotqa.py:
prompt files and a search index; textworld.py: an environment of its own, text games), change it,
and pass data.task=<its name or path>.
"""

import importlib
import importlib.util
import os

from nanoagent.config import task_names
from nanoagent.data import check_prompts, fit_prompts
from nanoagent.env import ChatEnv, tool_env
from nanoagent.tools import make_tools


def load_task(name):
    """The task module for a name in this folder, or for a path to a .py file."""
    if name.endswith(".py"):
        if not os.path.isfile(name):
            raise FileNotFoundError(f"task file {name!r} does not exist")
        spec = importlib.util.spec_from_file_location(
            f"nanoagent_task_{os.path.basename(name)[:-3]}", name)
        task = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(task)
    elif name in task_names():
        task = importlib.import_module(f"nanoagent.tasks.{name}")
    else:
        raise ValueError(f"unknown task {name!r}; tasks: {', '.join(task_names())}, "
                         "or a path to a task file (.py)")
    missing = [attr for attr in ("SYSTEM_PROMPT", "QUESTION", "prompts", "score", "demonstration", "prepare")
               if not hasattr(task, attr)]
    if getattr(task, "tools", None) is None and getattr(task, "environment", None) is None:
        missing.append("tools or environment")
    if missing:
        raise ValueError(f"task {name!r} does not define {', '.join(missing)} "
                         "(nanoagent/tasks/__init__.py says what a task defines)")
    return task


def task_env(task, cfg, tokenizer, tools=None):
    """The ChatEnv of a task under cfg.rollout, checked (ChatEnv.check): one of the task's environments
    per trajectory, or tool calling over its tools (or over `tools`, when given: rollout.py's and
    chat.py's --tools)."""
    r = cfg.rollout
    if tools is None and getattr(task, "environment", None) is not None:
        env = ChatEnv(task.environment(cfg), tokenizer, (), r.max_obs_tokens, r.context, r.keep_turns,
                      r.step_timeout_s)
    else:
        env = tool_env(task.tools(cfg) if tools is None else tools, tokenizer, r.max_obs_tokens,
                       r.tool_timeout_s, r.context, r.keep_turns, step_timeout_s=r.step_timeout_s,
                       tool_format=r.tool_format)
    # a tokenizer or template a rollout would fail on is refused now, before any model is built
    env.check()
    return env


def named_tools(names, cfg, index_dir=None):
    """The built-in tools rollout.py's and chat.py's --tools name, for any task: the search runs over
    index_dir (--index), else over the task's own index (task.index_dir, a search task's)."""
    return make_tools(names, index_dir or getattr(cfg.task, "index_dir", None),
                      top_k=getattr(cfg.task, "search_top_k", 3))


def task_data(task, cfg, tokenizer):
    """(train rows, val rows, the task's environments): the task's prompts, made on the spot or read
    from a file, every one checked (well-formed rows, then data.max_prompt_tokens with chat template
    and tool schemas included) when loaded, on every rank, before any collective."""
    what = {split: f"{cfg.data.task} {split} prompts" for split in ("train", "val")}
    prompts = {split: check_prompts(task.prompts(cfg, split), cfg.data.bad_prompts, what[split])
               for split in what}
    env = task_env(task, cfg, tokenizer)
    rows = {}
    for split, checked in prompts.items():
        lengths = env.prompt_lengths([p["messages"] for p in checked])
        rows[split] = fit_prompts(checked, lengths, cfg.data.max_prompt_tokens, cfg.data.bad_prompts,
                                  what[split])
    return rows["train"], rows["val"], env
