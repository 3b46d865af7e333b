"""The README and docs/ cannot drift from the code: the config reference (docs/config.md) is the one
the declarations generate, every preset is named, every test the reliability table names exists, the
README's file structure lists every module, every link between them resolves, and no figure the README
quoted before the split into docs/ was lost in the move. The scripts a user runs do not import the
tiny model's kit (tests and demos only). (The README's own task, "Train your own", is trained as it
stands by tests/test_tasks.py.)"""

import collections
import glob
import json
import os
import re
import subprocess
import sys

from nanoagent.config import PRESETS, reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURE = re.compile(r"(?<![\w.])\d+(?:[.,:]\d+)*")  # 0.78, 1,580, 2026-12-02's parts, 12:44


def read(name):
    return open(os.path.join(ROOT, name), encoding="utf-8").read()


def docs():
    return {os.path.relpath(p, ROOT): read(p) for p in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))}


def test_the_config_reference_matches_the_declarations_and_every_preset_is_named():
    section = read("docs/config.md")
    block = re.search(r"```\n(.*?)\n```", section, re.DOTALL)
    assert block, "docs/config.md: the config reference code block is missing"
    assert block.group(1) == reference(), (
        "docs/config.md's config reference is out of date; regenerate it with "
        "python -c 'from nanoagent.config import reference; print(reference())'"
    )
    text = read("README.md") + "".join(docs().values())
    for name in PRESETS:
        assert f"--config={name}" in text, f"no command of README.md or docs/ uses --config={name}"


def test_every_test_the_reliability_table_names_exists():
    named = re.findall(r"`(test_\w+\.py)::(\w+)`", read("docs/reliability.md"))
    assert len(named) >= 20
    for file, test in named:
        assert f"def {test}(" in read(os.path.join("tests", file)), (
            f"docs/reliability.md names {file}::{test}, which does not exist"
        )


def test_the_file_structure_lists_every_module_and_the_scripts_leave_the_tiny_kit_out():
    layout = read("README.md").split("## File structure", 1)[1].split("\n## ", 1)[0]
    modules = glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "nanoagent", "*.py"))
    for path in sorted(modules):
        name = os.path.relpath(path, ROOT)
        assert name == "nanoagent/__init__.py" or f"    {name} " in layout, (
            f"README.md's file structure lacks {name}"
        )
    code = ("import sys, train, rollout, chat; "
            "print(sorted(m for m in sys.modules if m.startswith('nanoagent.tiny')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    imported = out.strip().splitlines()[-1]
    assert imported == "[]", f"train.py, rollout.py or chat.py imports the tiny kit: {imported}"


def anchor(heading):
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_readme_and_docs_resolves():
    pages = {"README.md": read("README.md"), **docs()}
    for page, text in pages.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith("http"):
                continue
            path, _, fragment = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            assert os.path.exists(os.path.join(ROOT, resolved)), f"{page} links to {target}: no such file"
            if fragment:
                headings = re.findall(r"^#+ (.+)$", pages[resolved], re.M)
                assert fragment in {anchor(h) for h in headings}, f"{page} links to {target}: no such heading"
    assert len(read("README.md").splitlines()) <= 250, "README.md is a five-minute read: move detail to docs/"


def test_no_figure_the_readme_quoted_was_lost_in_the_move_to_docs():
    before = json.loads(read("tests/readme_figures.json"))["figures"]
    now = collections.Counter(FIGURE.findall("".join(docs().values())))
    lost = {figure: f"{count} before, {now[figure]} now"
            for figure, count in before.items() if now[figure] < count}
    assert not lost, f"docs/ no longer quotes these figures as often as the README did: {lost}"
