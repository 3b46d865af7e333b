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
                                  reset(row) and step(action) (nanoagent/env.py says what they return);
                                  or, for an agent of your own that builds its prompts itself,
    flow(client, row)          -> its outcome's reward: the agent's code, calling the model through
                                  client.chat(messages, tools=...) (nanoagent/flow.py); or
    agent(base_url, row)       -> the same, for an agent written against an OpenAI-compatible server,
                                  which calls nanoagent's endpoint at base_url (nanoagent/endpoint.py)
    prompts(cfg, split)        -> rows for split "train" or "val": dicts with "id", "messages"
                                  (system + user, chat format) and "answers"; made on the spot or
                                  read from the files prepare() wrote (nanoagent/data.py: load_prompts)
    score(traj, cfg)           -> sets traj.reward (a float) and traj.scores (a dict of floats to log);
                                  a flow's or an agent's task may leave it out: the reward it returned
    demonstration              None, or (row, rng, cfg) -> [assistant turn texts]: a scripted solution
                                  to imitate before RL (train.warm_start_steps)
    summarize                  optional: (row, messages) -> the demonstrator's summary of messages, for
                                  demonstrations under rollout.context=summary
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

from nanoagent.config import ConfigError, task_names
from nanoagent.data import balance_pools, check_prompts, fit_prompts
from nanoagent.endpoint import Endpoint
from nanoagent.env import ChatEnv, tool_env
from nanoagent.flow import flow_env
from nanoagent.tools import make_tools

DRIVERS = ("tools", "environment", "flow", "agent")  # what a task's trajectories are driven by: one of these


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
    drivers = [d for d in DRIVERS if getattr(task, d, None) is not None]
    if not hasattr(task, "score") and drivers and drivers[0] in ("flow", "agent"):
        task.score = score_outcome
    missing = [attr for attr in ("SYSTEM_PROMPT", "QUESTION", "prompts", "score", "demonstration", "prepare")
               if not hasattr(task, attr)]
    if not drivers:
        missing.append("tools, environment, flow or agent")
    if missing or len(drivers) > 1:
        raise ValueError(f"task {name!r} " + (f"does not define {', '.join(missing)}" if missing else
                                              f"defines {' and '.join(drivers)}: one of them drives it")
                         + " (nanoagent/tasks/__init__.py says what a task defines)")
    return task


def score_outcome(traj, cfg):
    """A flow's or an agent's trajectory earns what the flow returned (0 when it did not return: its
    trajectory ended first)."""
    traj.reward = traj.outcome if traj.outcome is not None else 0.0
    traj.scores = {"outcome": traj.reward}


def task_env(task, cfg, tokenizer, tools=None):
    """The ChatEnv of a task under cfg.rollout, checked (ChatEnv.check): one of the task's environments
    per trajectory, or tool calling over its tools (or over `tools`, when given: rollout.py's and
    chat.py's --tools)."""
    r = cfg.rollout
    driver = "tools" if tools is not None else next(d for d in DRIVERS if getattr(task, d, None) is not None)
    if driver in ("flow", "agent") and r.context != "full":
        raise ConfigError(f"rollout.context={r.context}: a task's {driver} builds every context itself "
                          "(its history truncated, summarised or rewritten as it likes); leave "
                          "rollout.context=full")
    if driver == "environment":
        env = ChatEnv(task.environment(cfg), tokenizer, (), r.max_obs_tokens, r.context, r.keep_turns,
                      r.step_timeout_s, summary_tokens=r.summary_tokens)
    elif driver == "flow":
        env = ChatEnv(flow_env(task.flow, r.step_timeout_s), tokenizer, (), r.max_obs_tokens,
                      step_timeout_s=r.step_timeout_s, tool_format=r.tool_format)
    elif driver == "agent":
        endpoint = Endpoint(cfg.model, r.temperature, r.top_p, r.max_new_tokens)
        env = ChatEnv(endpoint.agent_env(task.agent, r.step_timeout_s), tokenizer, (), r.max_obs_tokens,
                      step_timeout_s=r.step_timeout_s, tool_format=r.tool_format)
        env.endpoint = endpoint
    else:
        env = tool_env(task.tools(cfg) if tools is None else tools, tokenizer, r.max_obs_tokens,
                       r.tool_timeout_s, r.context, r.keep_turns, step_timeout_s=r.step_timeout_s,
                       tool_format=r.tool_format, summary_tokens=r.summary_tokens)
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
    and tool schemas included) when loaded, on every rank, before any collective; the training rows
    have the field data.balance_by balances them by."""
    what = {split: f"{cfg.data.task} {split} prompts" for split in ("train", "val")}
    prompts = {split: check_prompts(task.prompts(cfg, split), cfg.data.bad_prompts, what[split])
               for split in what}
    env = task_env(task, cfg, tokenizer)
    rows = {}
    for split, checked in prompts.items():
        lengths = env.prompt_lengths([p["messages"] for p in checked])
        rows[split] = fit_prompts(checked, lengths, cfg.data.max_prompt_tokens, cfg.data.bad_prompts,
                                  what[split])
    if cfg.data.balance_by:
        balance_pools(rows["train"], cfg.data.balance_by)
    return rows["train"], rows["val"], env
