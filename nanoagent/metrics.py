"""
What train.py measures and logs, kept out of the RL loop it would otherwise crowd: the step's
metrics, reduced over ranks in one collective each way, the one line printed per step, and the
greedy evaluation on held-out prompts. A metric says only what was measured: a value that no rank
measured in a step (the engine/trainer logprob gap when every trajectory was left out) is left
out of that step's metrics rather than logged as a perfect 0.
"""

import math

from nanoagent.agent import rollout_metrics, run_agent
from nanoagent.batch import packed_tokens
from nanoagent.common import reduce_metrics
from nanoagent.engine import SamplingConfig


def mean_over_updates(results):
    """[(shares, globals)] of one model's optimizer steps in this step -> their means."""
    mean = lambda dicts: ({k: sum(d[k] for d in dicts) / len(dicts) for k in dicts[0]}  # noqa: E731
                          if dicts else {})
    return mean([r[0] for r in results]), mean([r[1] for r in results])


def step_metrics(step, trajs, dropped, batch, policy_updates, critic_updates, kl, counts, times):
    """
    The step's metrics, reduced over ranks once: this rank's shares are summed, the values every
    rank agrees on (grad norms, skips) and the engine/trainer logprob gap are maxed. dropped:
    {reason: trajectories left out of the update}, logged as fractions of all trajectories.
    batch: the step's rows, with nucleus_logprobs over the trained tokens; kl: [R, L] k1 or None;
    counts: this rank's groups of the rollout (partial.rollout_step); times: perf_counter at the start
    of the step and after rollout, forward, update and push.
    """
    per_trajectory = {**rollout_metrics(trajs), **{k: v / len(trajs) for k, v in dropped.items()}}
    policy_shares, policy_globals = mean_over_updates(policy_updates)
    critic_shares, critic_globals = mean_over_updates(critic_updates)
    mask = batch["action_mask"]  # the trained tokens: where the trainer's logprobs were computed
    # the engine's logprobs against the trainer's of the same distribution (renormalised over the top_p
    # nucleus, model.old_policy_forward), on the tokens the policy of this step sampled (a partial rollout's
    # older ones differ by what training changed); -inf where this rank compared no token: the max over
    # ranks is then the gap of the ranks that did
    fresh = (mask > 0) & (batch["version"] == step)
    engine_diff = ((batch["nucleus_logprobs"] - batch["rollout_logprobs"]).abs()[fresh].max().item()
                   if fresh.any() else -math.inf)
    # what this rank's trainer passes computed
    update_tokens = packed_tokens(batch, (mask.sum(-1) > 0).nonzero().flatten().tolist())
    # how many steps before this one the policy that sampled each trained token was (partial rollouts)
    staleness = (step - batch["version"]) * mask
    sums = {**{k: v * len(trajs) for k, v in per_trajectory.items()}, **policy_shares, **critic_shares,
            "trajectories": len(trajs), "action_tokens": float(sum(sum(t.action_mask) for t in trajs)),
            "trained_tokens": mask.sum().item(), "tokens": float(sum(batch["lengths"])),
            "update_tokens": update_tokens, "ranks": 1, **counts, "staleness": staleness.sum().item(),
            "carried": sum(v is not None and v < step for v in (t.oldest_version() for t in trajs))}
    if kl is not None:
        sums["kl"] = kl.sum().item()
    maxes = {**policy_globals, **critic_globals, "engine_logprob_diff": engine_diff,
             "busiest_rank_tokens": update_tokens, "staleness_max": staleness.max().item()}
    total = reduce_metrics(sums, maxes)
    metrics = {"step": step + 1, **{k: total[k] / total["trajectories"] for k in per_trajectory}}
    metrics.update({k: total[k] for k in [*policy_shares, *critic_shares, *policy_globals, *critic_globals,
                                          "engine_logprob_diff"]})
    if metrics["engine_logprob_diff"] == -math.inf:  # every trajectory left out, or stale: nothing compared
        del metrics["engine_logprob_diff"]
    metrics["policy_updates"] = len(policy_updates)  # 0 when every trajectory was left out: no step taken
    # the busiest rank's trainer tokens over the mean rank's (1: even; every pass waits for the
    # busiest): train.balance_ranks
    metrics["rank_imbalance"] = total["busiest_rank_tokens"] * total["ranks"] / max(total["update_tokens"], 1)
    if kl is not None:  # over the tokens that train
        metrics["kl"] = total["kl"] / max(total["trained_tokens"], 1)
    # partial rollouts: the staleness of the trained tokens, the share of trajectories carried over from an
    # earlier step, the groups paused (running) and held (ended) into the next; dynamic sampling: groups
    # ended per group that trains
    metrics["staleness"] = total["staleness"] / max(total["trained_tokens"], 1)
    metrics["staleness_max"] = total["staleness_max"]
    metrics["carried"] = total["carried"] / total["trajectories"]
    metrics["paused"] = total["paused"]
    metrics["held"] = total["held"]
    metrics["refills"] = total["refills"]
    metrics["groups_kept"] = total["groups_kept"]
    if total["groups_kept"]:
        metrics["sampled_per_kept"] = total["groups_ended"] / total["groups_kept"]
    t0, t1, t2, t3, t4 = times
    metrics.update({"time/rollout": t1 - t0, "time/forward": t2 - t1, "time/update": t3 - t2,
                    "time/push": t4 - t3, "time/step": t4 - t0, "tokens_per_s": total["tokens"] / (t4 - t0),
                    "action_tokens_per_s": total["action_tokens"] / (t4 - t0)})
    return metrics


# what a sampled trajectory's record leaves out of Trajectory.to_json: the prompt's ids (its text is in the
# messages) and the per-token lists the viewer does not show (the logprob difference stands for them)
UNVIEWED = ("prompt_ids", "step_prompt_ids", "contexts", "rollout_logprobs", "versions", "response_text")


def sampled_trajectories(data, step, tokenizer, groups):
    """
    The first `groups` groups of this rank's step as report.py's trajectory viewer reads them, one
    record per trajectory (log.trajectories_per_step; train.py writes rank 0's to trajectories.jsonl):
    its Trajectory.to_json (the conversation, its tool calls, the ids of the response with their mask,
    the text of each sampled token), less UNVIEWED, with its step (as metrics.jsonl numbers them), its
    group and place in it, whether it trained (else why not) and, for each turn, each action token's
    advantage (None when the trajectory was left out) and the trainer's logprob within the rollout's
    nucleus minus the engine's (None where they were not compared: a token an older policy sampled,
    or left out). data: the StepData after the update (its batch with advantages and
    nucleus_logprobs); step: the loop's step (0-based), the version of the tokens its policy sampled.
    """
    batch, scores = data.batch, data.scores
    diff = batch["nucleus_logprobs"] - batch["rollout_logprobs"]
    compared = (batch["action_mask"] > 0) & (batch["version"] == step)
    records = []
    for i, t in enumerate(data.trajs):
        group = scores["group"][i].item()
        if group >= groups:
            break
        members = (scores["group"] == group).nonzero().flatten().tolist()
        trained = scores["trained"][i].item()
        advantages, diffs = [], []
        for row, start, end in batch["steps"][i]:
            a, d, c = batch["advantages"][row, start:end], diff[row, start:end], compared[row, start:end]
            advantages.append([round(x, 4) + 0.0 for x in a.tolist()] if trained else None)  # no -0.0
            diffs.append([round(x, 5) + 0.0 if on else None for x, on in zip(d.tolist(), c.tolist())])
        record = {k: v for k, v in t.to_json(tokenizer).items() if k not in UNVIEWED}
        records.append({"step": step + 1, "group": group, "member": members.index(i), "trained": trained,
                        **({} if trained else {"left_out": left_out_reason(data, i, members)}),
                        **record, "advantages": advantages, "logprob_diff": diffs})
    return records


def left_out_reason(data, i, members):
    """Why trajectory i of the step was left out of the update (batch.trained_rows)."""
    if data.trajs[i].finish_reason == "env_error":
        return "its environment failed"
    outcomes = {round(data.scores["outcome"][m].item(), 6) for m in members if data.scores["counted"][m]}
    if not data.scores["trained"][members].any() and len(outcomes) == 1:
        return "its group's rewards were all equal: no signal (grpo.drop_uniform_groups)"
    return "a budget cut it (train.overlong_filter)"


def duration(seconds):
    """A wall time as one reads it: 42s, 3m05s, 2h07m."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def step_line(metrics, cfg, first_step, elapsed):
    """
    The one line printed per step. The answer score is the task's (reward.metric: em by default) where
    its trajectories have one. Each KL says what it is of: kl_ref, the policy's to the reference (k1 over
    the trained tokens), when there is a reference (train.kl_mode); else kl_old, the update's approximate
    KL to the policy that sampled (k3). first_step: the step this process started at (a resumed run's);
    elapsed: seconds since its first step began, whose mean pace gives the ETA.
    """
    m, answer = metrics, cfg.reward.metric
    score = f" | {answer} {m[answer]:.3f}" if answer in m else ""
    # the update's statistics where there was one: none in the critic's warm-up, nor when every
    # trajectory was left out
    update = "TRAINED NOTHING: " + left_out(m) if m.get("trained") == 0 else "no policy update"
    if m["policy_updates"]:
        update = (f"clip {m['clipfrac']:.3f} | ent {m['entropy']:.3f} | gnorm {m['grad_norm']:.3f} | "
                  f"skip {m['skipped']:.2f}")
    if "kl" in m:
        kl = f"kl_ref {m['kl']:.4f} | "
    elif m["policy_updates"]:
        kl = f"kl_old {m['approx_kl']:.4f} | "
    else:
        kl = ""
    eta = elapsed / (m["step"] - first_step) * (cfg.steps - m["step"])
    # grpo.refill: the groups that train, of those asked for, and why fewer; partial rollouts: staleness
    kept = ""
    if cfg.grpo.refill:
        asked = cfg.rollout.prompts_per_step
        spent = " (grpo.max_refill's spare prompts spent)" if m["groups_kept"] < asked else ""
        kept = f" | groups {m['groups_kept']:.0f}/{asked}{spent}"
    if cfg.rollout.max_staleness:
        kept += f" | stale {m['staleness']:.2f} carried {m['carried']:.2f}"
    evaluation = f" | eval reward {m['eval/reward']:.3f}" if "eval/reward" in m else ""
    evaluation += f" {answer} {m['eval/' + answer]:.3f}" if "eval/" + answer in m else ""
    return (f"step {m['step']:4d}/{cfg.steps} | reward {m['reward']:.3f}{score} | turns {m['turns']:.2f} | "
            f"resp {m['response_tokens']:.0f} | "
            f"{kl}{update} | drop {m['dropped_uniform']:.2f}+{m['dropped_overlong']:.2f}{kept} | "
            f"rollout {m['time/rollout']:.1f}s fwd {m['time/forward']:.1f}s upd {m['time/update']:.1f}s "
            f"push {m['time/push']:.2f}s | "
            f"{m['tokens_per_s']:.0f} tok/s | elapsed {duration(elapsed)} eta {duration(eta)}{evaluation}")


def left_out(metrics):
    """Why a step's trajectories were left out of the update, from its dropped fractions (step_metrics)."""
    reasons = {"dropped_uniform": "in groups of equal rewards",
               "dropped_overlong": "cut by a budget (train.overlong_filter)",
               "dropped_env_error": "whose environment failed"}
    shares = [f"{metrics[k]:.0%} {why}" for k, why in reasons.items() if metrics.get(k)]
    return "trajectories left out: " + ", ".join(shares)


def idle_stop(metrics, steps):
    """Why a run stops after `steps` steps in a row that trained nothing (train.max_idle_steps), and
    what to do."""
    return (f"{steps} steps in a row trained nothing ({left_out(metrics)}; mean reward "
            f"{metrics['reward']:.3f}): a group whose rewards are all equal gives the policy no signal. "
            "Warm start by imitation (train.warm_start_steps), sample more per prompt "
            "(rollout.group_size), give partial credit (reward.format_weight), or an easier task; "
            "train.max_idle_steps=0 never stops. The last checkpoint holds this step")


def evaluate(engine, env, task, rows, cfg, rank, world):
    """Greedy rollouts on this rank's share of the held-out prompts; means over all ranks of the
    reward, turns, tool calls and the task's scores, overall and per question type (a row's `type`,
    e.g. eval/2-hop/tool_calls: the behaviour behind a score)."""
    rows = rows[:cfg.eval.num_prompts]
    mine = rows[rank::world]
    trajs = run_agent(engine, env, mine, SamplingConfig(cfg.rollout.max_new_tokens, greedy=True),
                      cfg.rollout.max_turns, cfg.rollout.max_context_tokens)
    for t in trajs:
        task.score(t, cfg)
    fields = ["reward", "turns", "tool_calls", *sorted({k for t in trajs for k in t.scores})]
    # from every rank's rows: the same keys on all ranks
    types = sorted({str(r["type"]) for r in rows if r.get("type")})
    groups = {"": trajs, **{f"{ty}/": [t for t, r in zip(trajs, mine) if str(r.get("type")) == ty]
                            for ty in types}}
    sums = {}
    # rollout_metrics' means, times the count: this rank's share of each total
    for prefix, members in groups.items():
        means = rollout_metrics(members)
        sums[prefix + "n"] = len(members)
        sums.update({prefix + k: means.get(k, 0.0) * len(members) for k in fields})
    total = reduce_metrics(sums, {})
    return {f"eval/{p}{k}": total[p + k] / max(total[p + "n"], 1) for p in groups for k in fields}
