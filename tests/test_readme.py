"""The README's config reference is the one the dataclasses generate, every test its reliability
table names exists, and its layout lists every module: none can drift. The scripts a user runs do
not import the tiny model's kit (tests and demos only)."""

import glob
import os
import re
import subprocess
import sys

from nanoagent.config import PRESETS, reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_config_reference_matches_the_dataclasses():
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split("## Config reference", 1)[1]
    block = re.search(r"```\n(.*?)\n```", section, re.DOTALL)
    assert block, "README.md: the config reference code block is missing"
    assert block.group(1) == reference(), ("README.md's config reference is out of date; regenerate it with "
                                           "python -c 'from nanoagent.config import reference; print(reference())'")
    for name in PRESETS:
        assert f"--config={name}" in readme


def test_every_test_the_reliability_table_names_exists():
    readme = open(os.path.join(ROOT, "README.md")).read()
    table = readme.split("## Reliability", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"`(test_\w+\.py)::(\w+)`", table)
    assert len(named) >= 20
    for file, test in named:
        assert f"def {test}(" in open(os.path.join(ROOT, "tests", file)).read(), f"README.md names {file}::{test}, which does not exist"


def test_the_layout_lists_every_module_and_the_scripts_leave_the_tiny_kit_out():
    readme = open(os.path.join(ROOT, "README.md")).read()
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    modules = glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "nanoagent", "*.py"))
    for path in sorted(modules):
        name = os.path.relpath(path, ROOT)
        assert name == "nanoagent/__init__.py" or f"    {name} " in layout, f"README.md's layout lacks {name}"
    code = ("import sys, train, rollout, chat; "
            "print(sorted(m for m in sys.modules if m.startswith('nanoagent.tiny')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    imported = out.strip().splitlines()[-1]
    assert imported == "[]", f"train.py, rollout.py or chat.py imports the tiny kit: {imported}"
