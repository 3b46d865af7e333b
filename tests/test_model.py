"""Forward passes over trajectories: packed micro-batches, exactly the padded rows' results; alignment
with the action mask and with the engine's logprobs; the critic's values."""

from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoTokenizer

import padded
from nanoagent import model as model_module
from nanoagent.agent import run_agent
from nanoagent.batch import micro_batches, micro_steps, share_prefix, unpack
from nanoagent.engine import HFEngine, SamplingConfig, stop_token_ids
from nanoagent.env import tool_env
from nanoagent.model import (Critic, Policy, attention_plan, critic_forward, forward_all, old_policy_forward,
                             policy_forward)
from nanoagent.logprobs import head_logprobs
from nanoagent.tools import calculator_tool

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("process_group")  # micro-batches are kept in step across ranks


def test_micro_batches_pack_rows_first_fit_decreasing_within_the_budget():
    lengths = [5, 17, 3, 9, 9, 40, 1, 12, 14]
    batches = micro_batches(lengths, token_budget=30)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert sum(lengths[i] for i in b) <= 30 or len(b) == 1
    assert [5] in batches  # the row longer than the budget stands alone
    # first-fit decreasing: 40 | 17 + 12 + 1 | 14 + 9 + 5 | 9 + 3, the fewest micro-batches there can be (70 tokens
    # besides the 40 need 3); padded to their longest rows, the same budget took 6
    assert batches == [[5], [1, 7, 6], [8, 3, 0], [4, 2]]


def rows_of_many_lengths(vocab, seed=0):
    """Token rows of 2 to 300 tokens with action masks (a prompt, then actions and observations), and
    three groups of four rows that share a prompt (5, 80 and 150 tokens), as a GRPO group's samples."""
    g = torch.Generator().manual_seed(seed)
    tokens = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    acting = lambda n: [1] + [int(x) for x in (torch.rand(n - 1, generator=g) > 0.4)]  # noqa: E731  (starts with an action)
    rows, masks = [], []
    for n in [2, 300, 7, 41, 3, 180, 12, 95, 60, 5]:
        rows.append(tokens(n))
        masks.append([0] + [int(x) for x in (torch.rand(n - 1, generator=g) > 0.4)])
    for prompt_length in (5, 80, 150):
        prompt = tokens(prompt_length)
        for own in (1, 37, 120, 9):
            rows.append(prompt + tokens(own))
            masks.append([0] * prompt_length + acting(own))
    return rows, masks


@pytest.mark.parametrize("budget", [10_000, 320, 64])
def test_packed_passes_give_the_padded_rows_logprobs_values_and_gradients(tiny_model_dir, budget):
    """fp32: the packed policy and critic passes (one micro-batch, or several, or a row per micro-batch;
    the rows of a shared prompt after one copy of it) give the padded computation's logprobs,
    entropy, nucleus logprobs and values on the action tokens, 0 elsewhere, and a loss over them the
    same gradient, to 1e-5."""
    model, plain = padded.load_policy(tiny_model_dir), padded.plain_lm(tiny_model_dir)
    rows, masks = rows_of_many_lengths(model.config.vocab_size)
    batch = padded.batch_of(rows, masks)
    mask = batch["action_mask"]
    ref_logprobs, ref_entropy, ref_nucleus = padded.logprobs(plain, rows, temperature=0.7, top_p=0.8)
    old = forward_all(lambda *packed: old_policy_forward(model, *packed, 0.7, 0.8),
                      batch, list(range(len(rows))), budget, CPU, per_token=(2,))
    torch.testing.assert_close(old[..., 0], ref_logprobs.detach() * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(old[..., 1], ref_nucleus * mask, atol=1e-5, rtol=1e-5)
    # the gradient of a loss over the logprobs and entropies of the action tokens
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    (ref_logprobs * weights + 0.1 * ref_entropy * weights).sum().backward()
    shared = 0
    for layout, get in micro_steps({**batch, "weights": weights}, list(range(len(rows))), budget, CPU):
        logprobs, entropy, _ = policy_forward(model, get("input_ids"), get("position_ids"), get("action_mask") > 0, 0.7)
        w = get("weights")
        (logprobs * w + 0.1 * entropy * w).sum().backward()
        shared += sum(batch["lengths"][i] for i in layout.rows) - get("input_ids").shape[1]
    assert shared > 0  # some group's prompt was packed once (at 64 tokens, the 5-token prompt's shorter rows still share it)
    grads = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)
    # the critic's values where they are read
    critic, plain_critic = Critic(model), padded.critic_of(tiny_model_dir)
    critic.value_head.load_state_dict(plain_critic.value_head.state_dict())
    values = forward_all(lambda *packed: critic_forward(critic, *packed), batch,
                         list(range(len(rows))), budget, CPU)
    with torch.no_grad():
        torch.testing.assert_close(values, padded.values(plain_critic, rows) * mask, atol=1e-5, rtol=1e-5)


def test_rows_that_begin_alike_read_one_copy_of_what_they_share(tiny_model_dir):
    """A warm start's demonstrations: different questions after one system prompt. share_prefix packs the
    tokens all rows begin with once a micro-batch (not past the first action of any, nor into a row's
    own question), and the logprobs and gradients stay the padded computation's, to 1e-5."""
    model, plain = padded.load_policy(tiny_model_dir), padded.plain_lm(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    system = tokens(60)
    questions = [tokens(n) for n in (9, 3, 20, 14)]
    questions[1] = questions[0][:2] + [questions[0][2] % 50 + 3]  # begins like another row's question
    rows = [system + q + tokens(n) for q, n in zip(questions, (30, 12, 41, 25))]
    masks = [[0] * (60 + len(q)) + [1] * (len(r) - 60 - len(q)) for q, r in zip(questions, rows)]
    batch = share_prefix(padded.batch_of(rows, masks))
    assert batch["prompt"].tolist() == [0] * 4 and batch["prompt_length"].tolist() == [60] * 4
    ref_logprobs = padded.logprobs(plain, rows)[0]
    mask = batch["action_mask"]
    (ref_logprobs * mask).sum().backward()
    packed = 0
    for layout, get in micro_steps(batch, list(range(len(rows))), 10_000, CPU):
        logprobs = policy_forward(model, get("input_ids"), get("position_ids"), get("action_mask") > 0)[0]
        unpacked = unpack(logprobs.detach()[..., None], layout, torch.zeros(*mask.shape, 1))[..., 0]
        torch.testing.assert_close(unpacked, ref_logprobs.detach() * mask, atol=1e-5, rtol=1e-5)
        (logprobs * get("action_mask")).sum().backward()
        packed += get("input_ids").shape[1]
    assert packed == sum(len(r) for r in rows) - 3 * 60
    grads = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def test_a_needed_token_must_not_open_its_row(tiny_model_dir):
    model = padded.load_policy(tiny_model_dir)
    ids, positions = torch.tensor([[5, 9, 11, 7, 8]]), torch.tensor([[0, 1, 2, 0, 1]])
    with pytest.raises(ValueError, match="opens its row"):
        policy_forward(model, ids, positions, torch.tensor([[False, True, False, True, False]]))


def test_attention_is_planned_once_a_forward_over_one_packed_sequence(tiny_model_dir, monkeypatch):
    """The rows' layout is read from the positions once a forward, not in every layer (on a GPU each
    read waits for the device), activation checkpointing's recompute included; a batch of several
    sequences is refused, not computed as if it were one."""
    lm = padded.load_causal_lm(tiny_model_dir).train()
    lm.gradient_checkpointing_enable()
    plans = []
    monkeypatch.setattr(model_module, "attention_plan", lambda positions: plans.append(positions) or attention_plan(positions))
    ids, positions = torch.tensor([[5, 9, 11, 7, 8, 4]]), torch.tensor([[0, 1, 2, 0, 1, 2]])
    policy_forward(Policy(lm), ids, positions, positions > 0)[0].sum().backward()
    assert len(plans) == 1 and lm.config.num_hidden_layers > 1
    with pytest.raises(ValueError, match="one packed sequence"):
        lm(input_ids=ids.repeat(2, 1))


def test_the_policy_makes_no_logits_tensor_forward_or_backward(tiny_model_dir, monkeypatch):
    """The LM head is fused with the logprob and entropy (logprobs.head_logprobs): neither the forward nor
    the backward of policy_forward makes a tensor of N x V / 2 elements or more (N action tokens, more
    than the hidden size, so the LM head's weight and its gradient are smaller; chunks of 4 x V logits).
    It used to make the [N, V] logits, and before that a second copy of them in the backward."""
    model = padded.load_policy(tiny_model_dir).train()
    chunked = partial(head_logprobs, chunk_elements=4 * model.config.vocab_size)
    monkeypatch.setattr(model_module, "head_logprobs", chunked)
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    positions = torch.arange(4 * hidden) % (2 * hidden)
    ids = torch.randint(0, vocab, (1, len(positions)), generator=torch.Generator().manual_seed(0))
    needed = positions[None] > 0
    tokens = int(needed.sum())
    sizes = []

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            inputs = {t.untyped_storage().data_ptr() for t in tensors}
            made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            # new storages only, not views of an input
            sizes.extend(t.untyped_storage().nbytes() // t.element_size() for t in made
                         if t.untyped_storage().data_ptr() not in inputs)
            return out
    with Allocations():
        logprobs, entropy, _ = policy_forward(model, ids, positions[None], needed)
        forward_sizes = list(sizes)
        (-logprobs.sum() + entropy.sum()).backward()
    assert tokens > hidden and forward_sizes and len(sizes) > len(forward_sizes)
    assert max(sizes) < tokens * vocab // 2, (max(sizes), tokens * vocab)


def test_policy_forward_is_aligned_and_matches_rollout(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    env = tool_env([calculator_tool()], tok)
    engine = HFEngine(tiny_model_dir, stop_token_ids(tok), tok.pad_token_id, dtype="float32", seed=1)
    samples = [{"id": i, "messages": [{"role": "user", "content": "What is " + "1+" * i + "1?"}]} for i in range(4)]
    trajs = run_agent(engine, env, samples, SamplingConfig(max_new_tokens=12, temperature=0.8), max_turns=2, max_context_tokens=512)
    model = padded.load_policy(tiny_model_dir)
    rows = [t.prompt_ids + t.response_ids for t in trajs]
    batch = padded.batch_of(rows, [[0] * len(t.prompt_ids) + t.action_mask for t in trajs])
    logprobs = forward_all(lambda *packed: policy_forward(model, *packed, 0.8)[0], batch,
                           list(range(len(rows))), 10_000, CPU)
    for i, t in enumerate(trajs):
        P, R = len(t.prompt_ids), len(t.response_ids)
        mask = torch.tensor(t.action_mask, dtype=torch.bool)
        # the row's logprobs at the action positions are the engine's rollout logprobs, 0 elsewhere
        torch.testing.assert_close(logprobs[i, P:P + R][mask], torch.tensor(t.rollout_logprobs)[mask], atol=1e-4, rtol=0)
        assert torch.all(logprobs[i, P:P + R][~mask] == 0) and torch.all(logprobs[i, :P] == 0)


def test_critic_values_are_aligned_and_trainable(tiny_model_dir):
    critic = Critic(padded.load_causal_lm(tiny_model_dir))
    ids, positions = torch.tensor([[5, 9, 11, 7, 5, 9]]), torch.tensor([[0, 1, 2, 3, 0, 1]])
    read = torch.tensor([[False, True, True, True, False, True]])
    values = critic_forward(critic, ids, positions, read)
    assert values.shape == (1, 6) and torch.all(values == 0)  # zero-initialised head
    torch.nn.init.normal_(critic.value_head.weight)
    values = critic_forward(critic, ids, positions, read)
    hidden = critic.backbone(input_ids=ids[:, :4]).last_hidden_state
    torch.testing.assert_close(values[0, 1:4], critic.value_head(hidden[0, :3]).squeeze(-1))
    assert values[0, 0] == 0 and values[0, 4] == 0
    values.sum().backward()
    assert critic.value_head.weight.grad.abs().sum() > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in critic.backbone.parameters())


def test_a_row_whose_positions_do_not_start_at_0_is_refused_where_it_is_read(tiny_model_dir):
    """The packed forward reads a segment that starts at position p > 0 as a row's own tokens after the
    last shared prompt (attention_plan); a row that is no such continuation used to be read as one,
    silently (logprobs off by up to 3.5e-2). Refused in the plan, and where a batch's rows are packed."""
    model = padded.load_policy(tiny_model_dir)
    ids = torch.randint(3, model.config.vocab_size, (1, 12))
    # no prompt before it; a prompt of 3 tokens, not 7
    for positions in ([5, 6, 7, 8], [0, 1, 2, 7, 8, 9, 10, 11]):
        n = len(positions)
        with pytest.raises(ValueError, match="no segment of at least .* tokens opened at 0 before it"):
            policy_forward(model,
                           ids[:, :n],
                           torch.tensor([positions]),
                           torch.ones(1, n, dtype=torch.bool).index_fill(1, torch.tensor([0]), False))
    # a row's own tokens after a shared prompt of 2: read as one
    attention_plan(torch.tensor([[0, 1, 2, 3, 4, 5, 2, 3, 4]]))
    rows, masks = [[5, 6, 7, 8], [5, 6, 9]], [[0, 0, 1, 1], [0, 0, 1]]
    batch = padded.batch_of(rows, masks)
    batch["position_ids"][1] += 3
    with pytest.raises(ValueError, match="row 1's position ids are not 0, 1, 2"):
        next(micro_steps(batch, [0, 1], 100, CPU))
