"""
The multi-turn agent loop: generate, step the environment, observe, repeat.

Each trajectory is scheduled on its own, as in verl's AgentLoop, SkyRL and AReaL: when its turn
finishes in the engine, its environment steps in the background (ChatEnv.start) while the engine
keeps decoding the other trajectories' turns, and its next turn enters the engine as soon as the
step is back (prefix caching reuses the KV of its earlier turns). A slow step holds up only its own
trajectory; tool calls waiting at the same moment run together (one batched search, tools.ToolRunner).
With seeds, trajectory i samples turn k with a seed derived from (seed, i, k), so what it samples
does not depend on when its steps came back or what else ran.

A trajectory is one token row, kept token-in/token-out:

    prompt | act_1 | obs_1 | act_2 | obs_2 | ... | act_n

act_k are the ids the engine sampled (action_mask 1, with their rollout logprobs), obs_k the ids the
environment appended (action_mask 0): the template's glue that closes the assistant turn, the
observation, the next assistant header. Nothing is decoded and re-encoded, so the trainer scores
exactly the tokens that were sampled. Each step's reward goes on its turn's last action token.
With rollout.context=last_k (Agent-R1 v0.1's step context) each turn's prompt is rendered afresh
from the system prompt, the task and the last K turns, and the trainer scores each (prompt, action)
pair as a sequence of its own (Trajectory.sequences). Earlier turns are re-rendered from their text,
so a prompt can differ from the tokens sampled before it; what is trained is what the engine saw.

How a trajectory ends (finish_reason): "done", the environment says so (a tool task's model
answered without a tool call, a game was won or lost); "truncated", a turn cut by the new-token
budget when the environment is done or it was the last allowed turn; "context_budget", cut by the
context budget, or the next observation would not fit; "max_turns", the last allowed turn passed
without the environment being done (gym's truncation); "env_error", a step failed or ran past
rollout.step_timeout_s (the reason in Trajectory.error). A cut turn that the environment ended
without reading as far as the cut (info["read_to_end"] False: a game reads a reply's first line)
is "done", its outcome the environment's. A cut turn before the last otherwise goes on: the
environment reads what was cut (an unclosed tool call is an error the model reads).
"""

import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field

from nanoagent.tools import CALL_END

FINISH_REASONS = ("done", "truncated", "context_budget", "max_turns", "env_error")


@dataclass
class Trajectory:
    sample: dict                                           # the data row (id, messages, answers, ...);
                                                           # its messages: what reset returned
    prompt_ids: list
    messages: list                                         # the conversation, prompt included
    env: object = None                                     # its environment (env.py), made for it alone
    response_ids: list = field(default_factory=list)       # full context: act_1 obs_1 ... act_n;
                                                           # last_k: act_1 ... act_n
    action_mask: list = field(default_factory=list)        # 1: sampled by the policy; 0: the environment's
    rollout_logprobs: list = field(default_factory=list)   # engine logprob of each token (0 where mask 0)
    versions: list = field(default_factory=list)           # the policy version (training step) that sampled
                                                           # each token (0 where mask 0)
    turn_spans: list = field(default_factory=list)         # [start, end) of each action in response_ids
    step_rewards: list = field(default_factory=list)       # the environment's reward for each turn
    step_prompts: list = field(default_factory=list)       # last_k: the prompt ids each turn was sampled from
    tool_calls: list = field(default_factory=list)         # ToolCall, with the turn it was made in
                                                           # (a tool task's steps' info)
    final_text: str = ""                                   # content of the last assistant turn
    finish_reason: str | None = None
    error: str | None = None                               # env_error: what went wrong
    reward: float = 0.0
    scores: dict = field(default_factory=dict)
    seed: int | None = None                                # its turns' seeds: turn_seed(seed, index, ...)
    index: int = 0                                         # its place in the batch it was started with
    start: int = 0                                         # which Rollouts.start call started it
    partial: tuple = ((), (), ())                          # a turn paused mid-way: (ids, logprobs, versions)
    pieces: int = 0                                        # how many times its current turn was paused

    def __len__(self):
        return len(self.prompt_ids) + len(self.response_ids)

    def next_prompt_ids(self):
        """The next turn's prompt: the row so far, or (last_k) the prompt rendered for it."""
        return self.step_prompts[-1] if self.step_prompts else self.prompt_ids + self.response_ids

    def sequences(self):
        """
        The token rows the trainer scores, as (ids, action_mask, rollout_logprobs, spans, versions),
        spans the [start, end) of each action in its row. With the full context one row, prompt |
        response; with context=last_k one row per turn: the prompt that turn was sampled from, then its
        action.
        """
        if not self.step_prompts:
            P = len(self.prompt_ids)
            return [(self.prompt_ids + self.response_ids, [0] * P + self.action_mask,
                     [0.0] * P + self.rollout_logprobs, [(P + s, P + e) for s, e in self.turn_spans],
                     [0] * P + self.versions)]
        return [(prompt + self.response_ids[s:e], [0] * len(prompt) + self.action_mask[s:e],
                 [0.0] * len(prompt) + self.rollout_logprobs[s:e],
                 [(len(prompt), len(prompt) + e - s)], [0] * len(prompt) + self.versions[s:e])
                for prompt, (s, e) in zip(self.step_prompts, self.turn_spans)]

    def oldest_version(self):
        """The policy version of its first sampled token (the oldest), None before it sampled any."""
        first = self.versions[self.turn_spans[0][0]] if self.turn_spans else None
        return first if first is not None else (self.partial[2] or [None])[0]

    def append(self, ids, mask, logprobs=None, versions=None):
        self.response_ids += ids
        self.action_mask += [mask] * len(ids)
        self.rollout_logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += versions if versions is not None else [0] * len(ids)

    def to_json(self, tokenizer):
        return {
            "id": self.sample.get("id"), "answers": self.sample.get("answers", []),
            "finish_reason": self.finish_reason, **({"error": self.error} if self.error else {}),
            "reward": self.reward, "scores": self.scores, "turns": len(self.turn_spans),
            "step_rewards": self.step_rewards, "final_text": self.final_text,
            "tool_calls": [{"turn": c.turn, "name": c.name, "arguments": c.arguments, "result": c.result,
                            "error": c.error, "seconds": round(c.seconds, 4)} for c in self.tool_calls],
            "messages": self.messages, "prompt_ids": self.prompt_ids, "response_ids": self.response_ids,
            "action_mask": self.action_mask, "rollout_logprobs": self.rollout_logprobs,
            "versions": self.versions, "turn_spans": self.turn_spans,
            "response_text": tokenizer.decode(self.response_ids, skip_special_tokens=False),
            **({"step_prompt_ids": self.step_prompts} if self.step_prompts else {}),
        }


def start_trajectories(env, samples, max_context_tokens):
    """One trajectory per sample, with an environment of its own, reset on the sample: its prompt ids
    are the conversation reset returns, rendered (with the tools' schemas, for a tool task), once
    for all the trajectories that reset to the same conversation (a group's, as a rule)."""
    trajs, rendered = [], {}  # repr(conversation) -> its prompt ids
    for s in samples:
        environment = env.make()
        try:
            messages = list(environment.reset(s))
        except Exception as e:
            raise RuntimeError(f"the environment of {s.get('id')!r} did not reset: "
                               f"{type(e).__name__}: {e}") from e
        key = repr(messages)
        if key not in rendered:
            rendered[key] = env.prompt_ids(messages)
        prompt_ids = rendered[key]
        if len(prompt_ids) >= max_context_tokens:
            raise ValueError(f"prompt {s.get('id')!r} is {len(prompt_ids)} tokens, "
                             f"over the context budget of {max_context_tokens}")
        trajs.append(Trajectory(sample={**s, "messages": messages}, prompt_ids=prompt_ids,
                                messages=list(messages), env=environment,
                                step_prompts=[prompt_ids] if env.context == "last_k" else []))
    return trajs


def turn_seed(seed, i, turn, piece=0):
    """The sampling seed of trajectory i's turn (None: unseeded): its own, whatever else runs; piece: the
    part of a turn after its piece-th pause (a partial rollout)."""
    return None if seed is None else (seed * 1_000_003 + i * 1009 + turn + piece * 7919) % 2**31


def take_turn(t, ids, logprobs, tokenizer, versions=None):
    """Append an action's ids to the trajectory. Returns its text (decoded, EOS excluded: what the
    environment steps on) and whether it ended with EOS."""
    start = len(t.response_ids)
    t.append(ids, 1, logprobs, versions)
    t.turn_spans.append((start, len(t.response_ids)))
    ended_with_eos = bool(ids) and ids[-1] == tokenizer.eos_token_id
    return tokenizer.decode(ids[:-1] if ended_with_eos else ids, skip_special_tokens=False), ended_with_eos


def observe(t, env, step, content, ended_with_eos, last_turn, cut, max_context_tokens):
    """
    Take a turn's step into the trajectory (step: its Future, ChatEnv.start). cut: None, or the
    finish reason of a turn the budget cut ("truncated" or "context_budget"). Returns True when the
    trajectory goes on, False when this ended it (module docstring).
    """
    assistant = {"role": "assistant", "content": content}
    try:
        observation, reward, done, info = step.result()
    except Exception as e:  # the environment failed: this trajectory ends, no other
        t.messages.append(assistant)
        t.step_rewards.append(0.0)
        t.final_text, t.finish_reason, t.error = content, "env_error", str(e)
        return False
    t.step_rewards.append(reward)
    t.tool_calls += info.get("tool_calls", [])
    if done or last_turn:
        t.messages.append(assistant)
        # the budget's reason, unless the environment ended the episode without reading as far as the
        # cut (a game reads the first line of a reply): then what it judged was whole, and the outcome
        # is the environment's
        budget_ended = cut and (not done or info.get("read_to_end", True))
        t.final_text, t.finish_reason = content, cut if budget_ended else "done" if done else "max_turns"
        return False
    observation = [{**m, "content": env.truncate(m["content"], m["role"])} for m in observation]
    if env.context == "full":
        obs_ids = env.observation_ids(t.messages, content, observation, ended_with_eos)
        next_length = len(t) + len(obs_ids)
    else:
        next_prompt = env.step_prompt_ids(t.messages + [assistant] + observation,
                                          len(t.sample["messages"]))
        next_length = len(next_prompt)
    if next_length >= max_context_tokens:
        t.messages.append(assistant)
        t.final_text, t.finish_reason = content, "context_budget"
        return False
    if env.context == "full":
        t.append(obs_ids, 0)
    else:
        t.step_prompts.append(next_prompt)
    t.messages += [assistant] + observation
    return True


class Rollouts:
    """
    The trajectories a rank has in flight, each scheduled on its own (module docstring). run_agent rolls a
    batch out to its end. A training step runs it until enough groups have ended (nanoagent/partial.py),
    then pause() aborts the turns still in the engine and keeps what each sampled; the next run submits
    them again, under the weights of then, from where they stopped: a turn's row is what each version
    sampled, in order, and every token records the version (training step) that sampled it. Environment
    steps in flight go on meanwhile; their time limit counts only the time the pool runs.
    """

    def __init__(self, engine, env, sampling, max_turns, max_context_tokens):
        self.engine, self.env, self.sampling = engine, env, sampling
        self.max_turns, self.max_context_tokens = max_turns, max_context_tokens
        self.version = 0      # the policy version generating: the training step
        self.starts = 0       # start() calls so far: a request id names its trajectory's
        self.generating = {}  # request id -> (trajectory, turn, budget, the turn's budget of new tokens)
        self.stepping = {}    # step future -> (trajectory, turn, content, ended with EOS, cut, started)
        self.paused = []      # (trajectory, turn): turns aborted by pause(), to submit again
        self.paused_at = None
        self.engine_s = self.idle_s = 0.0  # time in engine steps; with nothing to generate, waiting on steps

    def start(self, samples, seed=None):
        """Start one trajectory per sample (repeat samples for groups); returns them. With a seed,
        trajectory i samples turn k with a seed derived from (seed, i, k)."""
        trajs = start_trajectories(self.env, samples, self.max_context_tokens)
        for i, t in enumerate(trajs):
            t.seed, t.index, t.start = seed, i, self.starts
            self.submit(t, 0)
        self.starts += 1
        return trajs

    def submit(self, t, turn):
        """Queue a trajectory's turn in the engine, from where a pause left it."""
        done_ids = t.partial[0]
        prompt = t.next_prompt_ids() + list(done_ids)
        tokens = self.sampling.max_new_tokens - len(done_ids)
        budget = min(tokens, self.max_context_tokens - len(prompt))
        request_id = f"{t.start}.{t.index}-{turn}" + (f".{t.pieces}" if t.pieces else "")
        seed = turn_seed(t.seed, t.index, turn, t.pieces)
        self.engine.submit(request_id, prompt, self.sampling, budget, seed)
        self.generating[request_id] = (t, turn, budget, tokens)

    def run(self, enough=lambda: False):
        """Generate and step until every trajectory in flight has ended, or until enough() (asked after
        each engine step and each batch of observations) says so."""
        if self.paused_at is not None:  # the steps that ran while the pool was paused: their clock restarts
            self.stepping = {f: (*s[:-1], s[-1] + time.perf_counter() - self.paused_at)
                             for f, s in self.stepping.items()}
            self.paused_at = None
        for t, turn in self.paused:
            self.submit(t, turn)
        self.paused = []
        env = self.env
        while self.generating or self.stepping:
            start = time.perf_counter()
            # an engine that batches per call (HFEngine) waits for every step: a turn's requests go together
            if self.generating and (self.engine.continuous_batching or not self.stepping):
                for request_id, gen in self.engine.step():
                    t, turn, budget, tokens = self.generating.pop(request_id)
                    ids, logprobs, versions = t.partial
                    t.partial, t.pieces = ((), (), ()), 0
                    content, ended_with_eos = take_turn(
                        t, list(ids) + gen.token_ids, list(logprobs) + gen.logprobs, env.tokenizer,
                        list(versions) + [self.version] * len(gen.token_ids))
                    cut = (None if gen.finish_reason != "length"
                           else "context_budget" if budget < tokens else "truncated")
                    self.stepping[env.start(t.env, content)] = (t, turn, content, ended_with_eos, cut,
                                                                time.perf_counter())
                self.engine_s += time.perf_counter() - start
            else:  # nothing to generate until a step is back
                first_deadline = min(started for *_, started in self.stepping.values()) + env.step_timeout_s
                wait(self.stepping, timeout=max(0.0, first_deadline - time.perf_counter()),
                     return_when=FIRST_COMPLETED)
                self.idle_s += time.perf_counter() - start
            for future, (*_, started) in self.stepping.items():
                if time.perf_counter() - started > env.step_timeout_s:
                    env.expire(future)
            for future in [f for f in self.stepping if f.done()]:
                t, turn, content, ended_with_eos, cut, _ = self.stepping.pop(future)
                if observe(t, env, future, content, ended_with_eos, turn == self.max_turns - 1, cut,
                           self.max_context_tokens):
                    self.submit(t, turn + 1)
            if enough():
                break

    def pause(self):
        """Abort the turns in the engine, keeping what each sampled (Trajectory.partial), to go on from
        at the next run()."""
        for request_id, gen in self.engine.abort(list(self.generating)).items():
            t, turn, _, _ = self.generating.pop(request_id)
            ids, logprobs, versions = t.partial
            t.partial = (ids + tuple(gen.token_ids), logprobs + tuple(gen.logprobs),
                         versions + (self.version,) * len(gen.token_ids))
            t.pieces += 1
            self.paused.append((t, turn))
        self.paused_at = time.perf_counter()


def run_agent(engine, env, samples, sampling, max_turns, max_context_tokens, seed=None):
    """
    Roll out one trajectory per sample (repeat samples for groups) to its end, each scheduled on its
    own (Rollouts). env: a ChatEnv, which makes each trajectory's environment, runs its steps and owns
    the tokenizer and the chat template. seed: when given, trajectory i samples turn k with a seed
    derived from (seed, i, k). Returns the trajectories in the order of samples.
    """
    rollouts = Rollouts(engine, env, sampling, max_turns, max_context_tokens)
    trajs = rollouts.start(samples, seed)
    rollouts.run()
    return trajs


def rollout_metrics(trajs, seconds=None):
    """Summary of a batch of trajectories: one flat dict of floats."""
    n = max(len(trajs), 1)
    action_tokens = sum(sum(t.action_mask) for t in trajs)
    calls = [c for t in trajs for c in t.tool_calls]
    metrics = {
        "reward": sum(t.reward for t in trajs) / n,
        "step_reward": sum(sum(t.step_rewards) for t in trajs) / n,
        "turns": sum(len(t.turn_spans) for t in trajs) / n,
        "response_tokens": sum(len(t.response_ids) for t in trajs) / n,
        # the longest prompt + action
        "context_tokens": sum(max(len(ids) for ids, *_ in t.sequences()) for t in trajs) / n,
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
    Trajectories whose actions are given texts (demonstrations for a warm start), assembled as
    run_agent assembles sampled ones: the action ids are the text's tokens, + EOS unless the text
    ends with a stop tag (as the engine would have stopped), and the environments step for real,
    a turn's steps together (one batched search). scripts[i]: the assistant turn texts of
    samples[i]; a trajectory ends when its environment is done or its script is.
    """
    tokenizer = env.tokenizer
    trajs = start_trajectories(env, samples, max_context_tokens=float("inf"))
    for turn in range(max(map(len, scripts), default=0)):
        stepping = {}  # step future -> (trajectory, content, ended with EOS)
        for t, script in zip(trajs, scripts):
            if t.finish_reason or turn >= len(script):
                continue
            ids = tokenizer.encode(script[turn], add_special_tokens=False)
            ids += [] if script[turn].endswith(CALL_END) else [tokenizer.eos_token_id]
            content, ended_with_eos = take_turn(t, ids, None, tokenizer)
            stepping[env.start(t.env, content)] = (t, content, ended_with_eos)
        wait(stepping, timeout=env.step_timeout_s)
        for future, (t, content, ended_with_eos) in stepping.items():
            env.expire(future)  # those not back by now (the others have their outcome already)
            observe(t, env, future, content, ended_with_eos, False, None, float("inf"))
    return trajs
