"""The RL math: hand-computed cases and the properties the formulation promises."""

import math

import pytest
import torch

from nanoagent import rl
from nanoagent.logprobs import head_logprobs, nucleus_mask


def textbook_gae(rewards, values, gamma, lam):
    """GAE over a plain list of steps, the way it is written in the paper."""
    T = len(rewards)
    adv = [0.0] * T
    last = 0.0
    for t in reversed(range(T)):
        next_value = values[t + 1] if t + 1 < T else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv


# ----------------------------------------------------------------------------- masked_gae

def test_masked_gae_hand_computed():
    # one row: act, obs, obs, act, act ; reward 1 on the last action token
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 9.0, 0.25, 0.75]])
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0]])
    gamma, lam = 0.9, 0.8
    adv, ret = rl.masked_gae(rewards, values, mask, gamma, lam)
    # by hand, action tokens only: v = [0.5, 0.25, 0.75], r = [0, 0, 1]
    d2 = 1.0 + 0.0 - 0.75                  # 0.25
    d1 = 0.0 + 0.9 * 0.75 - 0.25           # 0.425
    d0 = 0.0 + 0.9 * 0.25 - 0.5            # -0.275
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    expected = torch.tensor([[a0, 0.0, 0.0, a1, a2]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, (expected + values) * mask)
    assert ret[0, 1] == 0 and ret[0, 2] == 0


def test_masked_gae_all_ones_is_textbook():
    g = torch.Generator().manual_seed(0)
    B, T = 4, 13
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    adv, ret = rl.masked_gae(rewards, values, torch.ones(B, T), gamma=0.97, lam=0.9)
    for b in range(B):
        expected = torch.tensor(textbook_gae(rewards[b].tolist(), values[b].tolist(), 0.97, 0.9))
        torch.testing.assert_close(adv[b], expected)
    torch.testing.assert_close(ret, adv + values)


@pytest.mark.parametrize("seed", range(5))
def test_masked_gae_observations_do_not_change_action_advantages(seed):
    g = torch.Generator().manual_seed(seed)
    T_act = 9
    rewards = torch.randn(1, T_act, generator=g)
    values = torch.randn(1, T_act, generator=g)
    adv_ref, ret_ref = rl.masked_gae(rewards, values, torch.ones(1, T_act), 0.99, 0.95)
    # insert observation tokens (mask 0, arbitrary values, zero reward) at random places, and padding
    keep = []
    for i in range(T_act):
        n_obs = int(torch.randint(0, 4, (1,), generator=g))
        keep += [None] * n_obs + [i]
    keep += [None] * 3
    T = len(keep)
    r2, v2, m2 = torch.zeros(1, T), torch.randn(1, T, generator=g) * 100, torch.zeros(1, T)
    for t, i in enumerate(keep):
        if i is not None:
            r2[0, t], v2[0, t], m2[0, t] = rewards[0, i], values[0, i], 1.0
    adv, ret = rl.masked_gae(r2, v2, m2, 0.99, 0.95)
    idx = [t for t, i in enumerate(keep) if i is not None]
    torch.testing.assert_close(adv[0, idx], adv_ref[0])
    torch.testing.assert_close(ret[0, idx], ret_ref[0])
    assert torch.all(adv[m2 == 0] == 0) and torch.all(ret[m2 == 0] == 0)


def test_masked_gae_rows_are_independent_and_empty_rows_are_zero():
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    adv, ret = rl.masked_gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv[0], torch.tensor([1.0 - 0.1, 1.0 - 0.2, 0.0]))
    assert torch.all(adv[1] == 0) and torch.all(ret[1] == 0)


def test_masked_gae_refuses_reward_on_observation_token():
    with pytest.raises(ValueError, match="mask-0"):
        rl.masked_gae(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]), 1.0, 1.0)


# ----------------------------------------------------------------------------- step_gae

def test_step_gae_hand_computed():
    """Two rows with several turns of uneven length, observations between them, a process reward on a
    turn's last token and the outcome on the last action token, and padding. Values are aligned like
    critic_forward's: index t holds the value of the state that has read tokens [0, t), so a step's
    V(s) sits at its action's first index."""
    #            p   p   a0  a0  a0  o   o   a1  o   a2  a2
    rewards = [[0., 0., 0., 0., .1, 0., 0., .1, 0., 0., 1.],
               [0., 0., 0., 0., 0., 0., -.05, 0., .5, 0., 0.]]  # a per-token term (e.g. the KL penalty) mid-turn
    values = [[9., 9., .4, 7., 7., 9., 9., .2, 9., .6, 7.],
              [9., 9., 9., .3, 7., 9., .1, 7., 7., 7., 7.]]
    #            p   p   p   a0  a0  o   a1  a1  a1  pad pad
    mask = [[0., 0., 1., 1., 1., 0., 0., 1., 0., 1., 1.],
            [0., 0., 0., 1., 1., 0., 1., 1., 1., 0., 0.]]
    steps = [[(0, 2, 5), (0, 7, 8), (0, 9, 11)], [(1, 3, 5), (1, 6, 9)]]
    gamma, lam = 0.9, 0.8
    adv, ret, vmask = rl.step_gae(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask), steps, gamma, lam)
    # row 0, by hand: V(s) = [0.4, 0.2, 0.6] (at each action's first index), r = [0.1, 0.1, 1.0]
    d2 = 1.0 + 0.0 - 0.6
    d1 = 0.1 + 0.9 * 0.6 - 0.2
    d0 = 0.1 + 0.9 * 0.2 - 0.4
    a2, a1 = d2, d1 + 0.72 * d2
    a0 = d0 + 0.72 * a1
    # row 1: V(s) = [0.3, 0.1], r = [0, -0.05 + 0.5]
    b1 = 0.45 - 0.1
    b0 = 0.0 + 0.9 * 0.1 - 0.3 + 0.72 * b1
    torch.testing.assert_close(adv, torch.tensor([[0, 0, a0, a0, a0, 0, 0, a1, 0, a2, a2],
                                                  [0, 0, 0, b0, b0, 0, b1, b1, b1, 0, 0]]))
    torch.testing.assert_close(vmask, torch.tensor([[0., 0, 1, 0, 0, 0, 0, 1, 0, 1, 0], [0., 0, 0, 1, 0, 0, 1, 0, 0, 0, 0]]))
    torch.testing.assert_close(ret, torch.tensor([[0, 0, a0 + .4, 0, 0, 0, 0, a1 + .2, 0, a2 + .6, 0],
                                                  [0, 0, 0, b0 + .3, 0, 0, b1 + .1, 0, 0, 0, 0]]))


def test_step_gae_with_one_token_steps_is_textbook_gae_over_steps():
    g = torch.Generator().manual_seed(0)
    K = 6  # steps of one action token each, after a one-token prompt / observation
    step_rewards, step_values = torch.randn(K, generator=g), torch.randn(K, generator=g)
    T = 2 * K
    rewards, values, mask = torch.zeros(1, T), torch.randn(1, T, generator=g), torch.zeros(1, T)
    steps = [[(0, 2 * k + 1, 2 * k + 2) for k in range(K)]]
    for k, (_, start, _) in enumerate(steps[0]):
        rewards[0, start], values[0, start], mask[0, start] = step_rewards[k], step_values[k], 1.0
    adv, ret, _ = rl.step_gae(rewards, values, mask, steps, 0.97, 0.9)
    expected = torch.tensor(textbook_gae(step_rewards.tolist(), step_values.tolist(), 0.97, 0.9))
    torch.testing.assert_close(adv[0, 1::2], expected)
    torch.testing.assert_close(ret[0, 1::2], expected + step_values)


def test_step_gae_refuses_steps_that_miss_or_overlap_actions_and_dropped_rows_are_zero():
    rewards, values = torch.zeros(2, 6), torch.ones(2, 6)
    mask = torch.tensor([[0., 1, 1, 0, 1, 1], [0., 0, 0, 0, 0, 0]])
    with pytest.raises(ValueError, match="miss action tokens"):
        rl.step_gae(rewards, values, mask, [[(0, 1, 3)], []], 1.0, 1.0)
    with pytest.raises(ValueError, match="overlap"):
        rl.step_gae(rewards, values, mask, [[(0, 1, 3), (0, 4, 6)], [(0, 4, 6)]], 1.0, 1.0)  # two trajectories claim one action
    with pytest.raises(ValueError, match="not in order"):
        rl.step_gae(rewards, values, mask, [[(0, 4, 6), (0, 1, 3)], []], 1.0, 1.0)
    with pytest.raises(ValueError, match="after a row's first token"):
        rl.step_gae(rewards, values, mask, [[(0, 0, 3), (0, 4, 6)], []], 1.0, 1.0)
    adv, ret, vmask = rl.step_gae(rewards, values, mask * torch.tensor([[1.], [0.]]), [[(0, 1, 3), (0, 4, 6)], [(1, 1, 3)]], 1.0, 1.0)
    assert not adv[1].any() and not ret[1].any() and not vmask[1].any()  # a row left out of the update (mask 0)


def test_step_gae_over_a_row_per_turn_is_step_gae_over_one_row():
    """With each turn in a row of its own (rollout.context=last_k) the recursion links the rows: the
    same values at the boundaries and the same rewards give the same advantages and returns as the one
    growing row, whatever the turns' prompts hold."""
    g = torch.Generator().manual_seed(1)
    one = {"rewards": torch.zeros(1, 14), "values": torch.randn(1, 14, generator=g), "mask": torch.zeros(1, 14)}
    spans = [(3, 5), (7, 10), (12, 14)]  # prompt 0-2, obs 5-6 and 10-11
    for s, e in spans:
        one["mask"][0, s:e] = 1
        one["rewards"][0, s:e] = torch.randn(e - s, generator=g)
    split = {k: torch.zeros(3, 9) for k in one}
    steps = []
    for k, (s, e) in enumerate(spans):  # each turn after a prompt of its own, 4 tokens; the value read at the action's first index
        split["values"][k] = torch.randn(9, generator=g)
        split["values"][k, 4] = one["values"][0, s]
        split["rewards"][k, 4:4 + e - s], split["mask"][k, 4:4 + e - s] = one["rewards"][0, s:e], 1
        steps.append((k, 4, 4 + e - s))
    adv, ret, vmask = rl.step_gae(one["rewards"], one["values"], one["mask"], [[(0, s, e) for s, e in spans]], 0.95, 0.9)
    adv_split, ret_split, vmask_split = rl.step_gae(split["rewards"], split["values"], split["mask"], [steps], 0.95, 0.9)
    for k, (s, e) in enumerate(spans):
        torch.testing.assert_close(adv_split[k, 4:4 + e - s], adv[0, s:e])
        torch.testing.assert_close(ret_split[k, 4], ret[0, s])
        assert vmask_split[k].tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0] and vmask[0, s] == 1
    assert adv_split[:, :4].abs().sum() == 0 and adv_split[split["mask"] == 0].abs().sum() == 0


# ----------------------------------------------------------------------------- grpo

def test_grpo_hand_computed():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    groups = torch.tensor([7, 7, 7, 3, 3, 5])
    adv = rl.grpo_advantages(scores, groups, eps=0.0)
    m, s = 1 / 3, math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    expected = torch.tensor([(1 - m) / s, -m / s, -m / s, 0.0, 0.0, 0.0])  # equal scores -> 0; group of one -> 0
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(rl.grpo_advantages(scores, groups, scale_by_std=False)[:3], torch.tensor([2 / 3, -1 / 3, -1 / 3]))


def test_grpo_identical_scores_give_zero_and_list_labels_work():
    adv = rl.grpo_advantages(torch.full((8,), 0.7), ["a"] * 4 + ["b"] * 4)
    assert torch.all(adv == 0)
    adv = rl.grpo_advantages(torch.tensor([0.0, 2.0, 5.0]), ["q1", "q1", "q2"])
    torch.testing.assert_close(adv, torch.tensor([-1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6), 0.0]))


def test_outcome_token_advantages_do_not_blow_up_a_process_reward():
    """Two trajectories of one outcome, one of which earned a process reward of 0.1 on its first turn:
    the group std must not turn that 0.1 into +-0.71. On turn k's tokens the advantage is the
    group-normalised outcome plus the process rewards from turn k on, unnormalised; without process
    rewards it is grpo_advantages on every action token."""
    #               p  a0  a0  o  a1  a1   (a row per trajectory, two turns each)
    mask = torch.tensor([[0., 1, 1, 0, 1, 1]] * 4)
    steps = [[(n, 1, 3), (n, 4, 6)] for n in range(4)]
    outcomes, groups = torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1])
    process = torch.zeros(4, 6)
    process[0, 2] = 0.1  # on the last token of trajectory 0's first turn
    adv = rl.outcome_token_advantages(rl.grpo_advantages(outcomes, groups, eps=0.0), process, mask, steps)
    s = 0.5 / math.sqrt(0.5)  # group 1: (score - mean 0.5) / std sqrt(0.5) = 0.71
    expected = torch.tensor([[0, .1, .1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, -s, -s, 0, -s, -s], [0, s, s, 0, s, s]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(rl.outcome_token_advantages(rl.grpo_advantages(outcomes, groups), torch.zeros(4, 6), mask, steps),
                               rl.grpo_advantages(outcomes, groups)[:, None] * mask)
    with pytest.raises(ValueError, match="mask-0"):
        rl.outcome_token_advantages(rl.grpo_advantages(outcomes, groups), process.roll(1, dims=1), mask, steps)


def test_uniform_groups_hand_built():
    """Groups whose scores are all equal (a group of one too) and only they; their GRPO advantages are all 0."""
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5 + 1e-9, 0.0, 0.0, 0.3])
    groups = torch.tensor([4, 4, 4, 9, 9, 9, 2, 2, 0, 0, 5])
    uniform = rl.uniform_groups(scores, groups)
    assert uniform.tolist() == [True] * 3 + [False] * 3 + [True] * 5
    assert torch.all(rl.grpo_advantages(scores, groups)[uniform] == 0)
    assert not rl.uniform_groups(torch.tensor([2.0, 2.0, 2.0 + 1e-3]), torch.tensor([1, 1, 1])).any()


# ----------------------------------------------------------------------------- policy loss

def test_ppo_policy_loss_hand_computed():
    old = torch.zeros(1, 5)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 10.0, 1.0]]))
    adv = torch.tensor([[1.0, -1.0, 2.0, -1.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    loss, stats = rl.ppo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.3, clip_dual=3.0)
    # r=1.5,A=1 -> max(-1.5,-1.3)=-1.3 ; r=0.5,A=-1 -> max(0.5,0.8)=0.8 ; r=1.1,A=2 -> -2.2 ;
    # r=10,A=-1 -> max(10,1.3)=10, dual min(10,3)=3 ; masked -> 0
    torch.testing.assert_close(loss, torch.tensor([[-1.3, 0.8, -2.2, 3.0, 0.0]]))
    torch.testing.assert_close(stats["clipfrac"], torch.tensor(0.5))  # tokens 0 and 1
    torch.testing.assert_close(stats["dual_clipfrac"], torch.tensor(0.25))


def test_ppo_ratio_one_gradient_is_policy_gradient():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 6, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (3, 6), generator=g)
    adv = torch.randn(3, 6, generator=g)
    mask = (torch.rand(3, 6, generator=g) > 0.3).float()
    logp = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    loss, _ = rl.ppo_policy_loss(logp, logp.detach(), adv, mask)
    (grad,) = torch.autograd.grad(loss.sum(), logits, retain_graph=True)
    (pg,) = torch.autograd.grad((-adv * logp * mask).sum(), logits)
    torch.testing.assert_close(grad, pg)


def test_ppo_loss_extreme_ratio_has_finite_gradient():
    logp = torch.tensor([[80.0, -80.0]], requires_grad=True)
    loss, _ = rl.ppo_policy_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()


# ----------------------------------------------------------------------------- value loss, KL, IS

def test_clipped_value_loss_hand_computed():
    values = torch.tensor([[1.0, 0.0, 0.5]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 0.4]])
    loss, stats = rl.clipped_value_loss(values, old, returns, torch.tensor([[1.0, 1.0, 0.0]]), clip_range=0.2)
    # v=1 clipped to 0.2: max(1, 0.04)=1 ; v=0 unchanged: 1 ; masked 0
    torch.testing.assert_close(loss, torch.tensor([[0.5, 0.5, 0.0]]))
    torch.testing.assert_close(stats["vf_clipfrac"], torch.tensor(0.0))
    loss, stats = rl.clipped_value_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[2.0]]), torch.ones(1, 1), 0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.5 * 1.8 ** 2]]))  # clipped 0.2 is further from 2
    assert stats["vf_clipfrac"] == 1.0


def test_kl_estimators_hand_computed_and_stable():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    torch.testing.assert_close(rl.kl_penalty(lp, ref, "k1"), torch.tensor([math.log(2.0)]))
    torch.testing.assert_close(rl.kl_penalty(lp, ref, "k3"), torch.tensor([0.5 - 1 + math.log(2.0)]))
    # k3 is the exact KL in expectation: sample-average over pi of a 3-outcome distribution
    pi, pref = torch.tensor([0.2, 0.5, 0.3]), torch.tensor([0.4, 0.4, 0.2])
    exact = (pi * (pi / pref).log()).sum()
    for est in ("k1", "k3"):
        torch.testing.assert_close((pi * rl.kl_penalty(pi.log(), pref.log(), est)).sum(), exact)
    huge = rl.kl_penalty(torch.tensor([-500.0]), torch.tensor([0.0]), "k3")
    assert torch.isfinite(huge).all()
    with pytest.raises(ValueError, match="k1, k3"):
        rl.kl_penalty(lp, ref, "k4")


def test_truncated_is_weights():
    w = rl.truncated_is_weights(torch.tensor([[0.0, 0.0, math.log(5.0)]]), torch.tensor([[0.0, math.log(2.0), 0.0]]),
                                torch.tensor([[1.0, 1.0, 0.0]]), cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.5, 0.0]]))
    w = rl.truncated_is_weights(torch.tensor([[math.log(5.0)]]), torch.zeros(1, 1), torch.ones(1, 1), cap=2.0)
    assert w.item() == 2.0 and not w.requires_grad


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, -50.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    torch.testing.assert_close(rl.masked_mean(x, mask), torch.tensor(2.5))
    torch.testing.assert_close(rl.masked_mean(x, mask, dim=-1), torch.tensor([1.5, 3.5]))
    assert rl.masked_mean(x, torch.zeros_like(mask)) == 0


# ----------------------------------------------------------------------------- logprobs and entropy

def head_logprobs_grads(hidden, weight, labels, w_lp, w_h, temperature, top_p=1.0, chunk_elements=2 ** 25):
    """(logprobs, entropy, nucleus, d/dhidden, d/dweight) of sum(w_lp * lp + w_h * h), head_logprobs."""
    x, w = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    lp, h, nucleus = head_logprobs(x, w, labels, temperature, top_p, chunk_elements)
    loss = (lp * w_lp).sum() + (0 if w_h is None else (h * w_h).sum())
    grad_x, grad_w = torch.autograd.grad(loss, (x, w))
    return lp.detach(), h.detach(), nucleus, grad_x, grad_w


def head_reference(hidden, weight, labels, w_lp, w_h, temperature, top_p=1.0):
    """The same written out plainly: the LM head's logits [N, V] in the weights' dtype (as the LM's own
    head computes them), their fp32 log-softmax, autograd."""
    x, w = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    logp_all = torch.log_softmax(torch.nn.functional.linear(x, w).float() / temperature, -1)   # [N, V]
    lp = logp_all.gather(-1, labels[:, None]).squeeze(-1)
    h = -(logp_all.exp() * logp_all).sum(-1)
    kept = nucleus_mask(logp_all.exp(), top_p)
    nucleus = lp - torch.logsumexp(logp_all.masked_fill(~kept, -torch.inf), -1)
    grad_x, grad_w = torch.autograd.grad((lp * w_lp).sum() + (0 if w_h is None else (h * w_h).sum()), (x, w))
    return lp.detach(), h.detach(), nucleus.detach(), grad_x, grad_w


def head_inputs(N, H, V, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, labels, torch.randn(N, generator=g), torch.randn(N, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_head_logprobs_match_autograd_reference(dtype, temperature, top_p):
    """The fused LM head + logprob + entropy gives the plain computation's values, nucleus logprobs and
    gradients (hidden states and weight); chunks of rows and of columns that divide neither N nor V."""
    hidden, weight, labels, w_lp, w_h = head_inputs(14, 16, 50, dtype, seed=2)
    lp, h, nucleus, grad_x, grad_w = head_logprobs_grads(hidden, weight, labels, w_lp, w_h, temperature,
                                                         top_p, chunk_elements=3 * 50 + 7)  # 3 rows, 11 cols
    ref_lp, ref_h, ref_nucleus, ref_x, ref_w = head_reference(hidden, weight, labels, w_lp, w_h, temperature,
                                                              top_p)
    assert lp.dtype == h.dtype == nucleus.dtype == torch.float32 and grad_x.dtype == grad_w.dtype == dtype
    assert not nucleus.requires_grad and (top_p < 1 or torch.equal(nucleus, lp))
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, ref_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nucleus, ref_nucleus, atol=1e-5, rtol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grad_x.float(), ref_x.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(grad_w.float(), ref_w.float(), atol=tol, rtol=tol)


def test_head_logprobs_chunks_change_nothing_but_rounding():
    """Chunking is a memory device only: any chunk size gives the same values and gradients, in fp32
    to the rounding of the sums whose order it changes (1e-5)."""
    hidden, weight, labels, w_lp, w_h = head_inputs(37, 24, 300, torch.float32, seed=4)
    whole = head_logprobs_grads(hidden, weight, labels, w_lp, w_h, 0.8, 0.9, chunk_elements=37 * 300)
    for chunk_elements in (1, 5 * 300, 16 * 300 + 1):
        chunked = head_logprobs_grads(hidden, weight, labels, w_lp, w_h, 0.8, 0.9, chunk_elements)
        for a, b in zip(chunked, whole):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("offset, scale", [(0.0, 1.0), (20.0, 1.0), (1e4, 30.0)])
def test_head_entropy_is_shift_invariant_at_large_logits(offset, scale):
    """Every logit of a row + offset changes no softmax: the fused head's entropy and its gradient stay those
    of an fp64 log-softmax of the same fp32 logits, at Qwen's vocabulary, where lse - E_p[z] lost them
    (entropy 6e-3 off at offset 20, 4.8 at 1e4; the one-hot rows' gradient 4e4 where it is ~0)."""
    N, H, V = 8, 64, 151936
    g = torch.Generator().manual_seed(0)
    hidden = torch.cat([torch.randn(N, H, generator=g) * scale, torch.ones(N, 1)], 1)
    weight = torch.cat([torch.randn(V, H, generator=g) * 0.3, torch.full((V, 1), offset)], 1)  # + offset
    labels = torch.randint(0, V, (N,), generator=g)
    x = hidden.clone().requires_grad_(True)
    _, entropy, _ = head_logprobs(x, weight, labels)
    grad_x, = torch.autograd.grad(entropy.sum(), x)
    z = torch.nn.functional.linear(hidden, weight).double().requires_grad_(True)  # the same fp32 logits
    logp = torch.log_softmax(z, -1)
    reference = -(logp.exp() * logp).sum(-1)
    grad_z, = torch.autograd.grad(reference.sum(), z)
    assert (entropy.double() - reference).abs().max() <= 1e-4
    assert (grad_x - grad_z.float() @ weight).abs().max() <= 1e-3


def test_entropy_gradient_only_when_used():
    """Without an entropy term in the loss (no gradient reaches the entropy output, and its
    backward is skipped), the gradient is that of the logprobs alone."""
    hidden, weight, labels, w_lp, _ = head_inputs(6, 8, 40, torch.float32, seed=5)
    *_, grad_x, grad_w = head_logprobs_grads(hidden, weight, labels, w_lp, None, 1.0, chunk_elements=4 * 40)
    *_, ref_x, ref_w = head_reference(hidden, weight, labels, w_lp, None, 1.0)
    torch.testing.assert_close(grad_x, ref_x, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad_w, ref_w, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- aggregation

@pytest.mark.parametrize("mode", rl.LOSS_AGGREGATIONS)
def test_gradient_independent_of_micro_batch_and_rank_split(mode):
    """One batch of 8 rows aggregated as 1x8, 4x2, 8x1 micro-batches, or as 2 ranks x 2x2: same gradient."""
    g = torch.Generator().manual_seed(3)
    B, T, V = 8, 10, 17
    weight = torch.randn(V, 16, generator=g)
    hidden = torch.randn(B, T, 16, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([10, 3, 7, 1, 0, 9, 5, 2])  # uneven rows; one without action tokens
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    adv = torch.randn(B, T, generator=g)
    old = torch.randn(B, T, generator=g) * 0.1 - 3
    global_tokens, global_seqs = mask.sum(), (mask.sum(-1) > 0).sum()

    def grad_for(splits):
        w = weight.clone().requires_grad_(True)
        for rows in splits:
            logp = torch.log_softmax(hidden[rows] @ w.T, -1).gather(-1, labels[rows, :, None]).squeeze(-1)
            per_token, _ = rl.ppo_policy_loss(logp, old[rows], adv[rows], mask[rows])
            rl.aggregate_loss(per_token, mask[rows], mode, global_tokens, global_seqs).backward()
        return w.grad

    full = grad_for([torch.arange(8)])
    for micro in (2, 1):
        torch.testing.assert_close(grad_for(list(torch.arange(8).split(micro))), full)
    # two ranks, each with two micro-batches of 2; their gradients are summed by the all-reduce
    rank_grads = [grad_for([torch.tensor([0, 5]), torch.tensor([2, 7])]), grad_for([torch.tensor([1, 3]), torch.tensor([4, 6])])]
    torch.testing.assert_close(rank_grads[0] + rank_grads[1], full)


def test_aggregation_modes_hand_computed():
    loss = torch.tensor([[1.0, 3.0, 9.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(rl.aggregate_loss(loss, mask, "token_mean", 3, 2), torch.tensor(8.0 / 3))
    torch.testing.assert_close(rl.aggregate_loss(loss, mask, "seq_mean_token_mean", 3, 2), torch.tensor((2.0 + 4.0) / 2))
    with pytest.raises(ValueError, match="token_mean, seq_mean_token_mean, step_mean_token_mean"):
        rl.aggregate_loss(loss, mask, "sum", 3, 2)


# -----------------------------------------------------------------------------
# the estimators of Agent-R1's comparison: RLOO, REINFORCE++, GSPO's sequence ratio, StepPO's whitening and mean

def test_rloo_baseline_is_the_mean_of_the_other_samples():
    """Group a: scores 1, 0, 0: the first's baseline is (0 + 0) / 2, the others' (1 + 0) / 2. Group b
    (all equal) and group c (one sample, no other to compare with) get 0. With its own sample in the
    baseline (the group mean: 1/3) the first would get 2/3."""
    adv = rl.rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 5.0]), ["a", "a", "a", "b", "b", "c"])
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0]))
    adv = rl.rloo_advantages(torch.tensor([3.0, 1.0]), torch.tensor([7, 7]))  # a group of two: each against the other
    torch.testing.assert_close(adv, torch.tensor([2.0, -2.0]))


def test_discounted_returns_run_over_a_trajectorys_actions_across_turns_and_rows():
    """REINFORCE++'s return: G_t = r_t + gamma * G_(next action token). Two turns with a tool result
    between them; the outcome 1.0 on the last token, a KL penalty -0.1 on the first. gamma 0.5: the
    last turn's tokens get 1 and 0.5, the first turn's 0.25 and -0.1 + 0.125. The tool result is
    skipped, not a boundary (verl's reset at every mask-0 token would leave the first turn 0 and
    -0.1). The same trajectory with a row per turn gives the same returns."""
    #                      p  a0  a0  o  o  a1  a1
    mask = torch.tensor([[0., 1, 1, 0, 0, 1, 1]])
    rewards = torch.tensor([[0., -0.1, 0, 0, 0, 0, 1.0]])
    returns = rl.discounted_returns(rewards, mask, [[(0, 1, 3), (0, 5, 7)]], 0.5)
    torch.testing.assert_close(returns, torch.tensor([[0., -0.1 + 0.125, 0.25, 0, 0, 0.5, 1.0]]))
    rows_mask = torch.tensor([[0., 1, 1, 0, 0, 0, 0], [0., 1, 1, 0, 0, 1, 1]])  # turn 2's row repeats turn 1 as context
    rows_mask[1, 1:3] = 0
    rows_rewards = torch.tensor([[0., -0.1, 0, 0, 0, 0, 0], [0., 0, 0, 0, 0, 0, 1.0]])
    per_turn = rl.discounted_returns(rows_rewards, rows_mask, [[(0, 1, 3), (1, 5, 7)]], 0.5)
    torch.testing.assert_close(per_turn, torch.tensor([[0., -0.1 + 0.125, 0.25, 0, 0, 0, 0], [0., 0, 0, 0, 0, 0.5, 1.0]]))


def test_whiten_over_tokens_or_over_steps_hand_computed():
    """Two steps of one advantage each, 3 tokens of 1.0 and 1 token of 3.0. Over tokens: mean 1.5, std
    (unbiased) 1.0; over steps (stats at one token per step, as step_gae's value_mask marks them):
    mean 2, std sqrt(2), so the long step does not count three times. Zero off the mask."""
    adv = torch.tensor([[0.0, 1, 1, 1, 0, 3]])
    mask = torch.tensor([[0.0, 1, 1, 1, 0, 1]])
    step_starts = torch.tensor([[0.0, 1, 0, 0, 0, 1]])
    torch.testing.assert_close(rl.whiten(adv, mask), torch.tensor([[0.0, -0.5, -0.5, -0.5, 0, 1.5]]) / math.sqrt(1 + 1e-8))
    s = 1 / math.sqrt(2 + 1e-8)
    torch.testing.assert_close(rl.whiten(adv, mask, step_starts), torch.tensor([[0.0, -s, -s, -s, 0, s]]))


def test_sequence_ratio_is_the_geometric_mean_clipped_as_a_whole():
    """GSPO: segment 1 has token ratios 2 and 0.5 (geometric mean 1, arithmetic 1.25); segment 2 one
    token of ratio 1.5, above 1 + clip_high. With A = 1 the loss is -1 on segment 1's tokens and -1.2
    (clipped) on segment 2's, whose gradient is then 0; on segment 1 each token's gradient is
    -A * s = -1 (GSPO-token: r_t = sg(s) pi(y_t) / sg(pi(y_t))). A negative advantage on a ratio of 5
    gets no dual clip (the token-level loss would stop at -A * clip_dual)."""
    old = torch.log(torch.tensor([[0.4, 0.4, 0.2, 0.1]]))
    new = torch.log(torch.tensor([[0.8, 0.2, 0.3, 0.1]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    segments = torch.tensor([[1, 1, 2, 0]])
    loss, stats = rl.ppo_policy_loss(new, old, torch.ones(1, 4), mask, 0.2, 0.2, 3.0, segments)
    torch.testing.assert_close(loss, torch.tensor([[-1.0, -1.0, -1.2, 0.0]]))
    loss.sum().backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-1.0, -1.0, 0.0, 0.0]]))
    assert stats["clipfrac"].item() == pytest.approx(1 / 3)
    big = torch.log(torch.tensor([[5.0]]))
    gspo, _ = rl.ppo_policy_loss(big, torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.2, 3.0, torch.zeros(1, 1, dtype=torch.long))
    token, _ = rl.ppo_policy_loss(big, torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.2, 3.0)
    assert gspo.item() == pytest.approx(5.0) and token.item() == pytest.approx(3.0)


def test_step_mean_weighs_every_turn_the_same():
    """Row 0: a trajectory of two steps, token losses 1, 3 (mean 2) and 6; row 1: one step of loss 4.
    unit_counts gives the denominators: by step, (2 + 6 + 4) / 3 = 4; by trajectory, (10/3 + 4) / 2;
    by token, 14 / 4."""
    loss = torch.tensor([[0.0, 1, 3, 0, 6], [0.0, 4, 0, 0, 0]])
    mask = torch.tensor([[0.0, 1, 1, 0, 1], [0.0, 1, 0, 0, 0]])
    steps = torch.tensor([[0, 1, 1, 0, 2], [0, 3, 0, 0, 0]])
    trajectories = torch.tensor([[0] * 5, [1] * 5])
    tokens, units, unit_tokens = rl.unit_counts(mask, steps, [0, 1])
    assert (tokens, units) == (4.0, 3)
    torch.testing.assert_close(rl.aggregate_loss(loss, mask, "step_mean_token_mean", tokens, units, unit_tokens), torch.tensor(4.0))
    tokens, units, unit_tokens = rl.unit_counts(mask, trajectories, [0, 1])
    torch.testing.assert_close(rl.aggregate_loss(loss, mask, "seq_mean_token_mean", tokens, units, unit_tokens), torch.tensor((10 / 3 + 4) / 2))
    torch.testing.assert_close(rl.aggregate_loss(loss, mask, "token_mean", tokens, units), torch.tensor(3.5))
    # a mini-batch of row 1 alone: its units only
    assert rl.unit_counts(mask, steps, [1])[:2] == (1.0, 1)
