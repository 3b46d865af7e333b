"""
Tasks. A task is one module, in this folder or anywhere else, that says everything task-specific
about training an agent on it; train.py, rollout.py, chat.py and prepare_data.py find it by name
(`data.task=hotpotqa`, a file here) or by path (`data.task=path/to/my_task.py`) and know nothing
else about it. A task module defines:

    SYSTEM_PROMPT              the system turn its prompts carry (chat.py starts conversations with it)
    QUESTION                   how a user's question is worded in its prompts, e.g. "Question: {}"
    tools(cfg)                 -> [Tool]: the tools the agent may call (nanoagent/tools.py)
    prompts(cfg, split)        -> rows for split "train" or "val": dicts with "id", "messages"
                                  (system + user, chat format) and "answers"; made on the spot or
                                  read from the files prepare() wrote (nanoagent/data.py: load_prompts)
    score(traj, cfg)           -> sets traj.reward (a float) and traj.scores (a dict of floats to log)
    demonstration              None, or (row, rng) -> [assistant turn texts]: a scripted solution
                                  to imitate before RL (train.warm_start_steps)
    prepare(out, train_size, val_size, seed, source)
                               None (prompts made on the spot), or writes OUT/train.parquet and
                               OUT/val.parquet (and anything else the task reads, e.g. a corpus)

Copy the task closest to yours (arithmetic.py: prompts made on the spot, one tool; hotpotqa.py:
prompt files and a search index), change it, and pass data.task=<its name or path>.
"""

import importlib
import importlib.util
import os

from nanoagent.config import task_names


def load_task(name):
    """The task module for a name in this folder, or for a path to a .py file."""
    if name.endswith(".py"):
        if not os.path.isfile(name):
            raise FileNotFoundError(f"task file {name!r} does not exist")
        spec = importlib.util.spec_from_file_location(f"nanoagent_task_{os.path.basename(name)[:-3]}", name)
        task = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(task)
    elif name in task_names():
        task = importlib.import_module(f"nanoagent.tasks.{name}")
    else:
        raise ValueError(f"unknown task {name!r}; tasks: {', '.join(task_names())}, or a path to a task file (.py)")
    missing = [attr for attr in ("SYSTEM_PROMPT", "QUESTION", "tools", "prompts", "score", "demonstration", "prepare") if not hasattr(task, attr)]
    if missing:
        raise ValueError(f"task {name!r} does not define {', '.join(missing)} (nanoagent/tasks/__init__.py says what a task defines)")
    return task
