"""speedrun.sh end to end on the CPU with offline inputs: HotpotQA JSON files and a corpus JSONL in
their real formats, the packaged MiniLM encoder, the tiny model, one training step. Every stage
runs, report.md has the validation metrics and stage times, and a rerun skips the finished stages."""

import json
import os
import sys

import procs
import pytest
from test_data import hotpot_record

from nanoagent.retriever import packaged_minilm_path

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTRA = ("steps=1 rollout.prompts_per_step=2 rollout.group_size=2 ppo.mini_batch_size=4 rollout.max_turns=2 "
         "rollout.max_new_tokens=16 rollout.max_context_tokens=2048 rollout.dtype=float32 rollout.compile=false train.dtype=float32 "
         "train.activation_checkpointing=false train.micro_batch_tokens=4096 eval.every=1 eval.num_prompts=4")


def test_speedrun_stages_on_the_cpu(tmp_path):
    source = tmp_path / "hotpot"
    source.mkdir()
    train, dev = [hotpot_record(i, "train") for i in range(8)], [hotpot_record(i, "dev") for i in range(4)]
    (source / "hotpot_train_v1.1.json").write_text(json.dumps(train))
    (source / "hotpot_dev_distractor_v1.json").write_text(json.dumps(dev))
    with open(tmp_path / "corpus.jsonl", "w") as f:
        for r in train + dev:
            for title, sentences in r["context"]:
                f.write(json.dumps({"_id": f"{r['_id']}-{title}", "title": title, "text": "".join(sentences)}) + "\n")
    out = tmp_path / "speedrun"
    (out / "done").mkdir(parents=True)
    (out / "done" / "install").touch()  # make install already ran: this is its venv
    env = {**os.environ, "NGPU": "1", "MODEL": "tiny", "OUT": str(out), "DATA": str(tmp_path / "data"), "SOURCE": str(source),
           "CORPUS": str(tmp_path / "corpus.jsonl"), "ENCODER": packaged_minilm_path(), "QUERY_PREFIX": "", "PASSAGE_PREFIX": "",
           "TRAIN_SIZE": "8", "VAL_SIZE": "4", "EXTRA": EXTRA, "PY": sys.executable,
           "TORCHRUN": os.path.join(os.path.dirname(sys.executable), "torchrun")}
    proc = procs.run(["bash", "speedrun.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stages = [line.split("\t")[0] for line in (out / "stages.tsv").read_text().splitlines()]
    assert stages == ["data", "index", "train", "eval"]
    report = (out / "report.md").read_text()
    assert "## Validation set: 4 questions" in report and "| substring_em |" in report and "| f1 |" in report
    assert "## Stages" in report and "GPU-hours" in report and "![reward.png](reward.png)" in report

    again = procs.run(["bash", "speedrun.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("done before, skipped") == 5
