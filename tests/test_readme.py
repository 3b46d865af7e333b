"""The README's config reference is the one the dataclasses generate, and every test its reliability
table names exists: neither can drift."""

import os
import re

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
