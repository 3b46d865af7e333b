"""
Tasks are files (nanoagent/tasks/): the built-in ones define the whole interface, a task is found by
name or by path, and a task written in a file of its own, outside the repository, trains.
"""

import json
import os
import sys

import pytest

import procs
from nanoagent.config import ConfigError, make_config
from nanoagent.tasks import DRIVERS, load_task, task_data, task_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_task():
    """The README's task of a user's own ("Train your own"), as it stands there: look a product's price
    up with a tool of its own, scored its own way."""
    section = open(os.path.join(ROOT, "README.md")).read().split("## Train your own", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


LOOKUP_TASK = readme_task()


def test_builtin_tasks_define_the_interface():
    assert task_names() == ["arithmetic", "corridor", "gsm8k", "hotpotqa", "openai_agent", "synthetic", "textworld"]
    for name in task_names():
        task = load_task(name)
        assert isinstance(task.SYSTEM_PROMPT, str) and "{}" in task.QUESTION
        assert sum(callable(getattr(task, driver, None)) for driver in DRIVERS) == 1  # what drives its trajectories
        assert callable(task.prompts) and callable(task.score)
    assert load_task("arithmetic").prepare is None and load_task("hotpotqa").demonstration is None


def test_tasks_are_found_by_name_or_path_and_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="unknown task 'nosuch'; tasks: arithmetic, corridor, gsm8k, hotpotqa, openai_agent, synthetic"):
        load_task("nosuch")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_task(str(tmp_path / "missing.py"))
    (tmp_path / "half.py").write_text("SYSTEM_PROMPT = ''\nQUESTION = '{}'\n")
    with pytest.raises(ValueError, match="does not define prompts, score, demonstration, prepare, tools, environment, flow or agent"):
        load_task(str(tmp_path / "half.py"))
    with pytest.raises(ConfigError, match="data.task='nosuch': not a task; valid: arithmetic, corridor, gsm8k, hotpotqa, openai_agent, synthetic"):
        make_config("tiny", ["data.task=nosuch"])


@pytest.mark.slow
def test_a_task_in_a_file_of_its_own_trains(tmp_path):
    """Copy a task, change it, pass data.task=<its path>: the trainer takes its prompts, tools,
    demonstrations and scoring, and nothing else changes."""
    (tmp_path / "lookup.py").write_text(LOOKUP_TASK)
    run_dir = tmp_path / "run"
    proc = procs.run([sys.executable, "train.py", "--config=tiny", f"data.task={tmp_path / 'lookup.py'}", f"run_dir={run_dir}",
                      "steps=1", "train.warm_start_steps=60", "train.warm_start_lr=3e-3", "rollout.prompts_per_step=4",
                      "ppo.mini_batch_size=8", "eval.every=1", "eval.num_prompts=4"],
                     capture_output=True, text=True, cwd=ROOT, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    step = [m for m in metrics if m["step"] == 1 and "reward" in m][0]
    assert "looked_up" in step and "eval/looked_up" in metrics[0]  # the task's own scores
    assert metrics[0]["eval/under 10/tool_calls"] == metrics[0]["eval/tool_calls"]  # per question type (all of val's are under 10)
    assert step["tool_calls"] > 0 and step["looked_up"] > 0  # its own tool, called as its demonstrations showed
    assert "exported" in proc.stdout


def test_every_tasks_prompts_get_the_load_check(tmp_path):
    """Prompts made on the spot go through the check prompt files get (nanoagent/data.py:
    check_prompts): train.py refuses a task's bad row when the data is loaded, before the
    tokenizer or any collective sees it, and the built-in tasks' rows pass it as they are."""
    import train
    from nanoagent.data import check_prompts
    from nanoagent.tasks import arithmetic
    from nanoagent.tasks.synthetic import make_split
    cfg = make_config("tiny")
    rows = arithmetic.prompts(cfg, "train") + make_split(seed=0, val_size=5, people=10, companies=3, cities=4, countries=2)[0]
    assert check_prompts(rows, "refuse", "built-in") == rows
    (tmp_path / "lookup.py").write_text(LOOKUP_TASK.replace('"answers": [PRICES[sku]]', '"answers": [int(PRICES[sku])]'))
    with pytest.raises(ValueError, match=r"lookup.py train prompts: 12 of 12 prompts cannot be trained on \(first: train-0 \(answers must "
                                         r"be a list of strings, got \[3\]\); train-1 .*data.bad_prompts=drop"):
        task_data(load_task(str(tmp_path / "lookup.py")), make_config("tiny", [f"data.task={tmp_path / 'lookup.py'}"]), tokenizer=None)
