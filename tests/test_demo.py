"""`make demo` end to end on the CPU: synthetic world -> MiniLM index -> tiny model -> warm start ->
GRPO -> evaluation -> report.md with the before/after metrics and the PNG plots."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_make_demo_writes_the_report(tmp_path):
    demo = tmp_path / "demo"
    proc = subprocess.run(["make", "demo", f"DEMO={demo}", f"PY={sys.executable}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("train.parquet", "val.parquet", "corpus.jsonl", "index/meta.json"):
        assert (demo / "data" / name).exists(), name
    run = demo / "run"
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    evals = [m for m in metrics if "eval/reward" in m]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == max(m["step"] for m in metrics) > 0
    report = (run / "report.md").read_text()
    assert "before RL (step 0)" in report and "after RL" in report
    for key in ("reward", "em", "substring_em", "f1", "turns"):
        assert f"| {key} |" in report
    for png in ("reward.png", "turns_length.png"):
        assert f"![{png}]({png})" in report
        assert (run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "hf" / "config.json").exists()
