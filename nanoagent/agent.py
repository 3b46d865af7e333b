"""
The multi-turn agent loop: generate, call tools, observe, repeat.

All live trajectories of a batch generate together in each turn; the tool calls of a turn run
together (one batched search); finished trajectories drop out. A trajectory is one token row

    prompt | act_1 | obs_1 | act_2 | obs_2 | ... | act_n

kept token-in/token-out: act_k are the ids the engine sampled (action_mask 1, with their rollout
logprobs), obs_k are the ids the environment appended (action_mask 0): the chat-template glue that
closes the assistant turn, the tool results, and the next assistant header. Nothing is ever
decoded and re-encoded, so the trainer scores exactly the tokens that were sampled.

A trajectory ends when the model answers without a tool call ("answer"), when a turn runs out of
new-token budget without a call ("truncated"), when it would exceed the context budget
("context_budget"), or when it makes a call in its last allowed turn ("max_turns").
"""

from collections import Counter
from dataclasses import dataclass, field

from nanoagent.tools import parse_tool_calls

FINISH_REASONS = ("answer", "truncated", "context_budget", "max_turns")


@dataclass
class Trajectory:
    sample: dict                                           # the data row: id, messages, answers, ...
    prompt_ids: list
    messages: list                                         # the conversation, prompt included
    response_ids: list = field(default_factory=list)
    action_mask: list = field(default_factory=list)        # 1: sampled by the policy; 0: added by the environment
    rollout_logprobs: list = field(default_factory=list)   # engine logprob of each response token (0 where mask 0)
    turn_spans: list = field(default_factory=list)         # [start, end) of each action in response_ids
    tool_calls: list = field(default_factory=list)         # ToolCall, with the turn it was made in
    final_text: str = ""                                   # content of the last assistant turn
    finish_reason: str | None = None
    reward: float = 0.0
    scores: dict = field(default_factory=dict)

    def __len__(self):
        return len(self.prompt_ids) + len(self.response_ids)

    def append(self, ids, mask, logprobs=None):
        self.response_ids += ids
        self.action_mask += [mask] * len(ids)
        self.rollout_logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def to_json(self, tokenizer):
        return {
            "id": self.sample.get("id"), "answers": self.sample.get("answers", []),
            "finish_reason": self.finish_reason, "reward": self.reward, "scores": self.scores,
            "turns": len(self.turn_spans), "final_text": self.final_text,
            "tool_calls": [{"turn": c.turn, "name": c.name, "arguments": c.arguments, "result": c.result,
                            "error": c.error, "seconds": round(c.seconds, 4)} for c in self.tool_calls],
            "messages": self.messages, "prompt_ids": self.prompt_ids, "response_ids": self.response_ids,
            "action_mask": self.action_mask, "rollout_logprobs": self.rollout_logprobs, "turn_spans": self.turn_spans,
            "response_text": tokenizer.decode(self.response_ids, skip_special_tokens=False),
        }


def run_agent(engine, env, samples, sampling, max_turns, max_context_tokens, seed=None):
    """
    Roll out one trajectory per sample (repeat samples for groups). env: a ToolEnv, which owns
    the tokenizer and the chat template. seed: when given, trajectory i samples turn k with its own
    seed derived from (seed, i, k), so a batch is reproducible whatever ran before it.
    Returns the trajectories in the order of samples.
    """
    tokenizer = env.tokenizer
    eos = tokenizer.eos_token_id
    trajs = []
    for s in samples:
        prompt_ids = env.prompt_ids(s["messages"])
        if len(prompt_ids) >= max_context_tokens:
            raise ValueError(f"prompt {s.get('id')!r} is {len(prompt_ids)} tokens, over the context budget of {max_context_tokens}")
        trajs.append(Trajectory(sample=s, prompt_ids=prompt_ids, messages=list(s["messages"])))
    live = list(trajs)
    position = {id(t): i for i, t in enumerate(trajs)}
    for turn in range(max_turns):
        if not live:
            break
        budgets = [min(sampling.max_new_tokens, max_context_tokens - len(t)) for t in live]
        seeds = None if seed is None else [(seed * 1_000_003 + position[id(t)] * 1009 + turn) % 2**31 for t in live]
        gens = engine.generate([t.prompt_ids + t.response_ids for t in live], sampling, budgets, seeds)
        pending = []  # (trajectory, content, ended_with_eos, calls) whose calls run this turn
        for t, g, budget in zip(live, gens, budgets):
            start = len(t.response_ids)
            t.append(g.token_ids, 1, g.logprobs)
            t.turn_spans.append((start, len(t.response_ids)))
            ended_with_eos = g.finish_reason == "stop" and g.token_ids[-1] == eos
            content = tokenizer.decode(g.token_ids[:-1] if ended_with_eos else g.token_ids, skip_special_tokens=False)
            calls = parse_tool_calls(content)
            for c in calls:
                c.turn = turn
            t.tool_calls += calls
            if not calls:
                t.messages.append({"role": "assistant", "content": content})
                t.final_text = content
                if g.finish_reason == "stop":
                    t.finish_reason = "answer"
                else:
                    t.finish_reason = "context_budget" if budget < sampling.max_new_tokens else "truncated"
            elif turn == max_turns - 1:
                t.messages.append({"role": "assistant", "content": content})
                t.final_text = content
                t.finish_reason = "max_turns"
            else:
                pending.append((t, content, ended_with_eos, calls))
        env.run([c for *_, calls in pending for c in calls])
        live = []
        for t, content, ended_with_eos, calls in pending:
            obs_ids, new_messages = env.observation_ids(t.messages, content, [c.result for c in calls], ended_with_eos)
            if len(t) + len(obs_ids) >= max_context_tokens:  # no room left for a single action token
                t.messages.append(new_messages[0])
                t.final_text = content
                t.finish_reason = "context_budget"
                continue
            t.append(obs_ids, 0)
            t.messages += new_messages
            live.append(t)
    return trajs


def rollout_metrics(trajs, seconds=None):
    """Summary of a batch of trajectories: one flat dict of floats."""
    n = max(len(trajs), 1)
    action_tokens = sum(sum(t.action_mask) for t in trajs)
    calls = [c for t in trajs for c in t.tool_calls]
    metrics = {
        "reward": sum(t.reward for t in trajs) / n,
        "turns": sum(len(t.turn_spans) for t in trajs) / n,
        "response_tokens": sum(len(t.response_ids) for t in trajs) / n,
        "action_tokens": action_tokens / n,
        "tool_calls": len(calls) / n,
        "tool_errors": sum(c.error for c in calls) / max(len(calls), 1),
    }
    for key in sorted({k for t in trajs for k in t.scores}):
        metrics[key] = sum(t.scores.get(key, 0.0) for t in trajs) / n
    reasons = Counter(t.finish_reason for t in trajs)
    for r in FINISH_REASONS:
        metrics[f"finish/{r}"] = reasons.get(r, 0) / n
    if seconds:
        metrics["seconds"] = seconds
        metrics["action_tokens_per_s"] = action_tokens / seconds
    return metrics



def scripted_trajectories(env, samples, scripts):
    """
    Trajectories whose actions are given texts (demonstrations for a warm start), assembled the
    way run_agent assembles sampled ones: the action ids are the text's tokens (+ EOS when the turn
    has no tool call), the tools run for real, all trajectories' calls of a turn together (one
    batched search), and the observations are the template's suffix. scripts[i]: the assistant
    turn texts of samples[i].
    """
    tokenizer = env.tokenizer
    trajs = [Trajectory(sample=s, prompt_ids=env.prompt_ids(s["messages"]), messages=list(s["messages"])) for s in samples]
    for turn in range(max(map(len, scripts), default=0)):
        pending = []  # (trajectory, content, calls) whose calls run this turn
        for t, script in zip(trajs, scripts):
            if t.finish_reason or turn >= len(script):
                continue
            content = script[turn]
            calls = parse_tool_calls(content)
            ids = tokenizer.encode(content, add_special_tokens=False) + ([] if calls else [tokenizer.eos_token_id])
            start = len(t.response_ids)
            t.append(ids, 1, [0.0] * len(ids))
            t.turn_spans.append((start, len(t.response_ids)))
            if not calls:
                t.messages.append({"role": "assistant", "content": content})
                t.final_text, t.finish_reason = content, "answer"
                continue
            for c in calls:
                c.turn = turn
            t.tool_calls += calls
            pending.append((t, content, calls))
        env.run([c for *_, calls in pending for c in calls])
        for t, content, calls in pending:
            obs_ids, new_messages = env.observation_ids(t.messages, content, [c.result for c in calls])
            t.append(obs_ids, 0)
            t.messages += new_messages
    return trajs
