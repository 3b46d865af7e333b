"""Forward passes over trajectories: alignment with the action mask, padding invariance, micro-batching."""

import torch
from transformers import AutoTokenizer

from nanoagent.agent import run_agent
from nanoagent.engine import HFEngine, SamplingConfig, stop_token_ids
from nanoagent.model import Critic, critic_forward, load_causal_lm, micro_batches, pad_rows, policy_forward
from nanoagent.env import tool_env
from nanoagent.tools import calculator_tool


def test_micro_batches_cover_every_row_within_the_budget():
    lengths = [5, 17, 3, 9, 9, 40, 1, 12]
    batches = micro_batches(lengths, token_budget=30)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        width = max(lengths[i] for i in b)
        assert len(b) * width <= 30 or len(b) == 1
        assert lengths[b[0]] == width  # longest first
    assert [5] in batches  # the row longer than the budget stands alone


def test_policy_forward_is_aligned_padding_invariant_and_matches_rollout(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    env = tool_env([calculator_tool()], tok)
    engine = HFEngine(tiny_model_dir, stop_token_ids(tok), tok.pad_token_id, dtype="float32", seed=1)
    samples = [{"id": i, "messages": [{"role": "user", "content": "What is " + "1+" * i + "1?"}]} for i in range(4)]
    trajs = run_agent(engine, env, samples, SamplingConfig(max_new_tokens=12, temperature=0.8), max_turns=2, max_context_tokens=512)
    model = load_causal_lm(tiny_model_dir)
    rows = [t.prompt_ids + t.response_ids for t in trajs]
    ids = pad_rows(rows, tok.pad_token_id)
    attn = pad_rows([[1] * len(r) for r in rows], 0)
    with torch.no_grad():
        logprobs, entropy = policy_forward(model, ids, attn, temperature=0.8)
    for i, t in enumerate(trajs):
        P, R = len(t.prompt_ids), len(t.response_ids)
        mask = torch.tensor(t.action_mask, dtype=torch.bool)
        # the row's logprobs at the action positions are the engine's rollout logprobs
        torch.testing.assert_close(logprobs[i, P:P + R][mask], torch.tensor(t.rollout_logprobs)[mask], atol=1e-4, rtol=0)
        with torch.no_grad():  # the same row alone, unpadded
            alone, alone_h = policy_forward(model, torch.tensor([rows[i]]), torch.ones(1, len(rows[i]), dtype=torch.long), 0.8)
        torch.testing.assert_close(logprobs[i, :len(rows[i])], alone[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(entropy[i, :len(rows[i])], alone_h[0], atol=1e-5, rtol=1e-5)
        assert logprobs[i, 0] == 0 and entropy[i, 0] == 0


def test_critic_values_are_aligned_and_trainable(tiny_model_dir):
    critic = Critic(load_causal_lm(tiny_model_dir))
    ids = torch.tensor([[5, 9, 11, 7], [5, 9, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    values = critic_forward(critic, ids, attn)
    assert values.shape == (2, 4) and torch.all(values == 0)  # zero-initialised head
    torch.nn.init.normal_(critic.value_head.weight)
    values = critic_forward(critic, ids, attn)
    hidden = critic.backbone(input_ids=ids, attention_mask=attn).last_hidden_state
    torch.testing.assert_close(values[0, 1:], critic.value_head(hidden[0, :-1]).squeeze(-1))
    values[0, 1:].sum().backward()
    assert critic.value_head.weight.grad.abs().sum() > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in critic.backbone.parameters())
