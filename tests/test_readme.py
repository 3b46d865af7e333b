"""The README's config reference is the one the dataclasses generate: it cannot drift."""

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
