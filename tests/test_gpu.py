"""
The GPU path on a GPU (`make test-gpu`; skipped without CUDA): the same code the CPU suite runs
in bf16 on gloo, here with NCCL and CUDA kernels, at a real model's shape. A random-weight model of
Qwen2.5-1.5B's shape (with the tiny tokenizer: no downloads) takes one PPO and one GRPO step with
FSDP2 over every GPU of the machine, bf16 compute, activation checkpointing and the transformers
fallback engine, exports and checks the export; the update benchmark prints tokens/s, MFU and
peak memory.
"""

import json
import os
import sys

import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

import procs
from nanoagent.tiny import ensure_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def qwen_shaped_dir(tmp_path_factory):
    """A random Qwen2.5-1.5B-shaped checkpoint in bf16, as Qwen ships it, with the tiny tokenizer."""
    path = str(tmp_path_factory.mktemp("qwen_shaped"))
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    config = Qwen2Config(**QWEN_1_5B, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_one_step_fsdp2_nccl_bf16(algo, qwen_shaped_dir, tmp_path):
    nproc = torch.cuda.device_count()
    cmd = [*procs.torchrun(nproc), "train.py",
           "--config=tiny", f"model={qwen_shaped_dir}", f"algo={algo}", "steps=1", f"run_dir={tmp_path / 'run'}",
           "rollout.engine=hf", "rollout.dtype=bfloat16", "train.dtype=bfloat16", "train.activation_checkpointing=true",
           "train.warm_start_steps=2", f"rollout.prompts_per_step={8 * nproc}", f"ppo.mini_batch_size={16 * nproc}",
           # random weights earn one reward for all: without this DAPO would leave every group out and nothing would update
           *(["train.kl_mode=loss", "grpo.drop_uniform_groups=false"] if algo == "grpo" else ["train.kl_mode=reward"])]
    proc = procs.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    [step] = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if '"time/step"' in line]
    assert step["skipped"] == 0 and step["tokens_per_s"] > 0
    assert all(isinstance(v, str) or v == v for v in step.values())  # no NaN anywhere
    assert "every tensor checked" in proc.stdout


def test_update_bench_prints_throughput():
    proc = procs.run([sys.executable, "bench/bench_train.py", "--update-only"], capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens/s per GPU" in proc.stdout and "MFU" in proc.stdout and "peak memory" in proc.stdout
    print(proc.stdout)
