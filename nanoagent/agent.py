"""
The multi-turn agent loop: generate, call tools, observe, repeat.

Each trajectory is scheduled on its own, as the systems we learn from do (verl's AgentLoop, SkyRL,
AReaL): its turn is a request in the engine; when the request finishes, its tool calls start in
the background (ToolEnv.start) while the engine keeps decoding the other trajectories' turns; when
its results are back, its next turn enters the engine at once, and prefix caching reuses the KV of
its earlier turns. A trajectory that answers in one turn frees its slot; a slow tool holds up only
the trajectory that called it. Tool calls that are waiting at the same moment run together (one
batched search). With seeds, trajectory i samples turn k with a seed of its own derived from
(seed, i, k), so what it samples does not depend on when its tools answered or what else ran.

A trajectory is one token row

    prompt | act_1 | obs_1 | act_2 | obs_2 | ... | act_n

kept token-in/token-out: act_k are the ids the engine sampled (action_mask 1, with their rollout
logprobs), obs_k are the ids the environment appended (action_mask 0): the chat-template glue that
closes the assistant turn, the tool results, and the next assistant header. Nothing is ever
decoded and re-encoded, so the trainer scores exactly the tokens that were sampled.

With rollout.context=last_k (ToolEnv.context) a turn does not see the whole trajectory: the
environment renders its prompt afresh from the conversation, the system prompt and the question
with the last K turns (Agent-R1 v0.1's step context; Trajectory.step_prompts). Each turn is then a
pair (the prompt ids it was sampled from, the ids it sampled), token-in/token-out within the turn,
and the trainer scores each pair as a sequence of its own (Trajectory.sequences). Earlier turns
are re-rendered from their text in later prompts, so a turn's prompt can differ from the tokens
sampled before it; what is trained is always what the engine saw and sampled.

A trajectory ends when the model answers without a tool call ("answer"); when a turn is cut by the
new-token budget, without a call or in the last allowed turn ("truncated"), or by the context budget
("context_budget", as when the next observation would not fit); or when it makes a call in its last
allowed turn ("max_turns"). A turn cut inside a tool call before the last turn goes on: the model
reads that its call was not closed.
"""

import time
from concurrent.futures import FIRST_COMPLETED, wait
from collections import Counter
from dataclasses import dataclass, field

from nanoagent.tools import parse_tool_calls, turn_messages

FINISH_REASONS = ("answer", "truncated", "context_budget", "max_turns")


@dataclass
class Trajectory:
    sample: dict                                           # the data row: id, messages, answers, ...
    prompt_ids: list
    messages: list                                         # the conversation, prompt included
    response_ids: list = field(default_factory=list)       # full context: act_1 obs_1 ... act_n; last_k: act_1 ... act_n
    action_mask: list = field(default_factory=list)        # 1: sampled by the policy; 0: added by the environment
    rollout_logprobs: list = field(default_factory=list)   # engine logprob of each response token (0 where mask 0)
    turn_spans: list = field(default_factory=list)         # [start, end) of each action in response_ids
    step_prompts: list = field(default_factory=list)       # last_k: the prompt ids each turn was sampled from
    tool_calls: list = field(default_factory=list)         # ToolCall, with the turn it was made in
    final_text: str = ""                                   # content of the last assistant turn
    finish_reason: str | None = None
    reward: float = 0.0
    scores: dict = field(default_factory=dict)

    def __len__(self):
        return len(self.prompt_ids) + len(self.response_ids)

    def next_prompt_ids(self):
        """What the next turn is sampled from: the row so far, or (last_k) the prompt rendered for it."""
        return self.step_prompts[-1] if self.step_prompts else self.prompt_ids + self.response_ids

    def sequences(self):
        """
        The token rows the trainer scores, as (ids, action_mask, rollout_logprobs, spans), spans the
        [start, end) of each action in its row. With the full context one row, prompt | response;
        with context=last_k one row per turn: the prompt that turn was sampled from, then its action.
        """
        if not self.step_prompts:
            P = len(self.prompt_ids)
            return [(self.prompt_ids + self.response_ids, [0] * P + self.action_mask, [0.0] * P + self.rollout_logprobs,
                     [(P + s, P + e) for s, e in self.turn_spans])]
        return [(prompt + self.response_ids[s:e], [0] * len(prompt) + self.action_mask[s:e],
                 [0.0] * len(prompt) + self.rollout_logprobs[s:e], [(len(prompt), len(prompt) + e - s)])
                for prompt, (s, e) in zip(self.step_prompts, self.turn_spans)]

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
            **({"step_prompt_ids": self.step_prompts} if self.step_prompts else {}),
        }


def start_trajectories(env, samples, max_context_tokens):
    """One empty trajectory per sample: its prompt ids, rendered with the tools' schemas."""
    trajs = []
    for s in samples:
        prompt_ids = env.prompt_ids(s["messages"])
        if len(prompt_ids) >= max_context_tokens:
            raise ValueError(f"prompt {s.get('id')!r} is {len(prompt_ids)} tokens, over the context budget of {max_context_tokens}")
        trajs.append(Trajectory(sample=s, prompt_ids=prompt_ids, messages=list(s["messages"]),
                                step_prompts=[prompt_ids] if env.context == "last_k" else []))
    return trajs


def turn_seed(seed, i, turn):
    """The sampling seed of trajectory i's turn (None: unseeded): its own, whatever else runs."""
    return None if seed is None else (seed * 1_000_003 + i * 1009 + turn) % 2**31


def take_turn(t, gen, budget, turn, max_turns, max_new_tokens, tokenizer):
    """
    Append a generated action to the trajectory. Returns (content, ended_with_eos, calls) when its
    tool calls are to run and the trajectory goes on, None when this turn ended it.
    """
    start = len(t.response_ids)
    t.append(gen.token_ids, 1, gen.logprobs)
    t.turn_spans.append((start, len(t.response_ids)))
    ended_with_eos = gen.finish_reason == "stop" and gen.token_ids[-1] == tokenizer.eos_token_id
    content = tokenizer.decode(gen.token_ids[:-1] if ended_with_eos else gen.token_ids, skip_special_tokens=False)
    calls = parse_tool_calls(content)
    for c in calls:
        c.turn = turn
    t.tool_calls += calls
    if calls and turn < max_turns - 1:
        return content, ended_with_eos, calls
    t.messages.append({"role": "assistant", "content": content})
    t.final_text = content
    # A turn the budget cut is labelled by the cut even when it opened a tool call: its text is
    # unfinished, which is what overlong filtering and the finish/truncated metric count.
    if gen.finish_reason == "length":
        t.finish_reason = "context_budget" if budget < max_new_tokens else "truncated"
    elif calls:
        t.finish_reason = "max_turns"
    else:
        t.finish_reason = "answer"
    return None


def observe(t, env, content, ended_with_eos, calls, max_context_tokens):
    """Add a turn's tool results: with the full context append their observation ids to the row;
    with last_k render the next turn's prompt. False when that leaves no room for another action
    token (the trajectory ends, "context_budget"), True when the trajectory goes on."""
    results = [c.result for c in calls]
    if env.context == "full":
        obs_ids, new_messages = env.observation_ids(t.messages, content, results, ended_with_eos)
        next_length = len(t) + len(obs_ids)
    else:
        new_messages = turn_messages(content, results)
        next_prompt = env.step_prompt_ids(t.messages + new_messages, len(t.sample["messages"]))
        next_length = len(next_prompt)
    if next_length >= max_context_tokens:
        t.messages.append(new_messages[0])
        t.final_text = content
        t.finish_reason = "context_budget"
        return False
    if env.context == "full":
        t.append(obs_ids, 0)
    else:
        t.step_prompts.append(next_prompt)
    t.messages += new_messages
    return True


def run_agent(engine, env, samples, sampling, max_turns, max_context_tokens, seed=None, timing=None):
    """
    Roll out one trajectory per sample (repeat samples for groups); each is scheduled on its own
    (module docstring). env: a ToolEnv, which owns the tokenizer and the chat template. seed: when
    given, trajectory i samples turn k with a seed derived from (seed, i, k). timing: a dict that
    gets "engine_s" (time in engine steps) and "idle_s" (time with nothing to generate, waiting for
    tools). Returns the trajectories in the order of samples.
    """
    trajs = start_trajectories(env, samples, max_context_tokens)
    generating, running_tools = {}, {}  # request id -> (i, turn, budget);  tool future -> (i, turn, content, eos, calls)
    engine_s = idle_s = 0.0

    def submit(i, turn):
        prompt = trajs[i].next_prompt_ids()
        budget = min(sampling.max_new_tokens, max_context_tokens - len(prompt))
        engine.submit(f"{i}-{turn}", prompt, sampling, budget, turn_seed(seed, i, turn))
        generating[f"{i}-{turn}"] = (i, turn, budget)

    for i in range(len(trajs)):
        submit(i, 0)
    while generating or running_tools:
        start = time.perf_counter()
        # an engine that batches per call (HFEngine) waits for every tool so that a turn's requests go together
        if generating and (engine.continuous_batching or not running_tools):
            for request_id, gen in engine.step():
                i, turn, budget = generating.pop(request_id)
                pending = take_turn(trajs[i], gen, budget, turn, max_turns, sampling.max_new_tokens, env.tokenizer)
                if pending is not None:
                    running_tools[env.start(pending[2])] = (i, turn, *pending)
            engine_s += time.perf_counter() - start
        else:  # nothing to generate until a tool answers
            wait(running_tools, return_when=FIRST_COMPLETED)
            idle_s += time.perf_counter() - start
        for future in [f for f in running_tools if f.done()]:
            i, turn, content, ended_with_eos, calls = running_tools.pop(future)
            future.result()  # raises what the environment raised
            env.truncate_results(calls)
            if observe(trajs[i], env, content, ended_with_eos, calls, max_context_tokens):
                submit(i, turn + 1)
    if timing is not None:
        timing.update(engine_s=engine_s, idle_s=idle_s)
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
        "context_tokens": sum(max(len(ids) for ids, *_ in t.sequences()) for t in trajs) / n,  # the longest prompt + action
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
    trajs = start_trajectories(env, samples, max_context_tokens=float("inf"))
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
            observe(t, env, content, False, calls, max_context_tokens=float("inf"))
    return trajs
