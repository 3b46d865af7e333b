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
from the system prompt, the task and the last K turns; with rollout.context=summary the whole
trajectory until its next prompt would pass rollout.summary_tokens, then the model writes a summary
of it (a turn of its own, sampled and trained like any other: its reward is the outcome it leads to)
and the next turns see the system prompt, the task, the summary and the last turn; and an
environment may give the whole next context itself (env.py: a flow's next model call, a history it
truncated or rewrote). Each turn then records the context and the prompt ids it was sampled from
(step_prompts). Where a context goes on from an earlier turn's (that turn's messages, its reply as
sampled, new messages), that turn's ids are kept and only the new messages are rendered
(context_prompt_ids), so the ids stay the ones sampled; the trainer then scores both turns in one
growing row (Trajectory.assemble), the shared prefix once. A context that does not go on from one
(older turns left out, a rewritten history) is rendered afresh and starts a row of its own: what is
trained is what the engine saw.

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

import math
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field

from nanoagent.env import Action, Context, checked_context, is_messages
from nanoagent.tools import CALL_END

FINISH_REASONS = ("done", "truncated", "context_budget", "max_turns", "env_error")
# rollout.context=summary: the turn that asks for a summary, and how the next turns read it
SUMMARY_REQUEST = ("Your context is nearly full. Summarise the conversation so far for yourself: the task, "
                   "what you have found, and what is left to do. Reply with the summary only.")
SUMMARY_HEADER = "Your summary of the conversation so far:\n"


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
    step_prompts: list = field(default_factory=list)       # step contexts (last_k, summary, contexts an
                                                           # environment gives): the prompt ids each turn
                                                           # was sampled from
    contexts: list = field(default_factory=list)           # the Context each turn's prompt was rendered from
    replies: list = field(default_factory=list)            # each turn's (text, ended with EOS), as the
                                                           # environment read it
    tool_calls: list = field(default_factory=list)         # ToolCall, with the turn it was made in
                                                           # (a tool task's steps' info)
    final_text: str = ""                                   # content of the last assistant turn
    finish_reason: str | None = None
    error: str | None = None                               # env_error: what went wrong
    outcome: float | None = None                           # the reward the environment gave the episode
                                                           # (env.py: a flow's return), if it did
    reward: float = 0.0
    scores: dict = field(default_factory=dict)
    seed: int | None = None                                # its turns' seeds: turn_seed(seed, index, ...)
    index: int = 0                                         # its place in the batch it was started with
    start: int = 0                                         # which Rollouts.start call started it
    partial: tuple = ((), (), ())                          # a turn paused mid-way: (ids, logprobs, versions)
    pieces: int = 0                                        # how many times its current turn was paused
    summaries: int = 0                                     # context=summary: its summary turns so far
    summarizing: bool = False                              # the turn in flight is a summary

    def __len__(self):
        return len(self.prompt_ids) + len(self.response_ids)

    def next_prompt_ids(self):
        """The next turn's prompt: the row so far, or (last_k) the prompt rendered for it."""
        return self.step_prompts[-1] if self.step_prompts else self.prompt_ids + self.response_ids

    def sequences(self):
        """
        The token rows the trainer scores, as (ids, action_mask, rollout_logprobs, spans, versions),
        spans the [start, end) of each action in its row (assemble).
        """
        return self.assemble()[0]

    def assemble(self):
        """
        (the rows, and each turn's place in them as (row, start, end), in turn order). With the full
        context one row, prompt | response. With step contexts each turn's prompt goes on the longest
        row it goes on from (the row's ids are its first tokens: a context that went on from that turn's,
        or from any earlier turn's on that row), the tokens it adds to that row with mask 0, then the
        action; a prompt that goes on from no row starts one. A trajectory that never took a turn (its
        environment failed first) is its prompt alone, with no action.
        """
        if not self.step_prompts:
            P = len(self.prompt_ids)
            places = [(0, P + s, P + e) for s, e in self.turn_spans]
            return [(self.prompt_ids + self.response_ids, [0] * P + self.action_mask,
                     [0.0] * P + self.rollout_logprobs, [(s, e) for _, s, e in places],
                     [0] * P + self.versions)], places
        rows, places = [], []  # rows: [ids, mask, logprobs, spans, versions]
        for prompt, (s, e) in zip(self.step_prompts, self.turn_spans):
            on = [k for k, row in enumerate(rows)
                  if len(row[0]) <= len(prompt) and prompt[:len(row[0])] == row[0]]
            k = max(on, key=lambda k: len(rows[k][0])) if on else len(rows)
            if not on:
                rows.append([[], [], [], [], []])
            row = rows[k]
            added = len(prompt) - len(row[0])
            row[0] += prompt[len(row[0]):] + self.response_ids[s:e]
            row[1] += [0] * added + self.action_mask[s:e]
            row[2] += [0.0] * added + self.rollout_logprobs[s:e]
            row[4] += [0] * added + self.versions[s:e]
            row[3].append((len(prompt), len(prompt) + e - s))
            places.append((k, len(prompt), len(prompt) + e - s))
        if not rows:
            P = len(self.step_prompts[0])
            rows.append([self.step_prompts[0], [0] * P, [0.0] * P, [], [0] * P])
        return [tuple(row) for row in rows], places

    def turn_ids(self, k):
        """(the prompt ids turn k was sampled from, the ids it sampled)."""
        s, e = self.turn_spans[k]
        prompt = self.step_prompts[k] if self.step_prompts else self.prompt_ids + self.response_ids[:s]
        return prompt, self.response_ids[s:e]

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
            "turn_tokens": [token_texts(tokenizer, self.response_ids[s:e]) for s, e in self.turn_spans],
            **({"step_prompt_ids": self.step_prompts,
                "contexts": [{"messages": c.messages, **({"tools": c.tools} if c.tools is not None else {})}
                             for c in self.contexts]} if self.step_prompts else {}),
        }


def token_texts(tokenizer, ids):
    """
    The text of each token of ids (a turn's sampled ids), as the tokenizer decodes them together: the
    texts join into tokenizer.decode(ids). A character whose bytes span several tokens is the text of
    the last of them (the others: ''). The ids are decoded as they are, never encoded again.
    """
    alone = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)
    if "".join(alone) == tokenizer.decode(ids, skip_special_tokens=False):
        return alone
    # incremental, as a streaming detokenizer: each token decoded after the one before it (for the
    # tokenizers that decode a token at the start of a text differently), held back while it ends in
    # an unfinished character
    texts, context, start = [], 0, 0  # ids[context:start]: given their text already
    for end in range(1, len(ids) + 1):
        before = tokenizer.decode(ids[context:start], skip_special_tokens=False)
        after = tokenizer.decode(ids[context:end], skip_special_tokens=False)
        if after.endswith("\ufffd") and end < len(ids):
            texts.append("")
            continue
        texts.append(after[len(before):])
        context, start = start, end
    return texts


def start_trajectories(env, samples, max_context_tokens):
    """One trajectory per sample, with an environment of its own, reset on the sample: its prompt ids
    are the context reset returns (a conversation, or a Context: a flow's first call), rendered (with
    the tools' schemas, for a tool task), once for all the trajectories that reset to the same context
    (a group's, as a rule). One whose environment did not reset, or whose first prompt is over the
    context budget, ends there ("env_error", no turn taken, one EOS token for a row). Flows (an
    environment with begin(row)) all start before the first is waited for."""
    trajs, rendered = [], {}  # repr(context) -> its prompt ids
    environments = [env.make() for _ in samples]
    for environment, s in zip(environments, samples):  # flows run up to their first calls side by side
        if hasattr(environment, "begin"):
            environment.begin(s)
    for environment, s in zip(environments, samples):
        error, told = None, None
        try:
            first = environment.reset(s)
            if isinstance(first, Context):  # made and checked by nanoagent (a flow's first call)
                context = first
            elif isinstance(first, dict):
                context = checked_context(first, "reset")
            elif is_messages(first) and first:
                context = Context(list(first))
            else:
                raise TypeError("reset returned neither a non-empty list of {'role': str, 'content': str} "
                                "messages nor a context {'messages': [...]}")
            key = repr((context.messages, context.tools))
            if key not in rendered:
                rendered[key] = env.prompt_ids(context.messages, context.tools)
            prompt_ids = rendered[key]
            if len(prompt_ids) >= max_context_tokens:
                told = "context_budget"
                error = (f"the first prompt is {len(prompt_ids)} tokens, over the context budget of "
                         f"{max_context_tokens} (rollout.max_context_tokens)")
        except Exception as e:
            context = Context([])
            error = f"the environment did not reset: {type(e).__name__}" + (f": {e}" if str(e) else "")
        if error:
            prompt_ids = [env.tokenizer.eos_token_id]
        t = Trajectory(sample={**s, "messages": context.messages}, prompt_ids=prompt_ids,
                       messages=list(context.messages), env=environment,
                       step_prompts=[prompt_ids] if env.context != "full" else [], contexts=[context])
        if error:  # the environment hears why (a flow's call over the budget: context_budget)
            finish(t, "env_error", error, told)
        trajs.append(t)
    return trajs


def finish(t, reason, error=None, told=None):
    """End a trajectory: its finish reason (and, env_error, what went wrong); its environment hears of
    it (finish(told or reason), where it has one: a flow's calls fail from then on)."""
    t.finish_reason, t.error = reason, error
    end = getattr(t.env, "finish", None)
    if end is not None:
        end(told or reason)
    return False


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
    content = tokenizer.decode(ids[:-1] if ended_with_eos else ids, skip_special_tokens=False)
    t.replies.append((content, ended_with_eos))
    return content, ended_with_eos


def context_prompt_ids(t, env, context):
    """
    The prompt ids of a step context. Where it goes on from an earlier turn's context (the same tools,
    that turn's messages, then an assistant message with that turn's text, then new messages), they
    are that turn's prompt and sampled ids followed by the template's rendering of the new messages
    alone (ChatEnv.observation_ids), as the full context would append them; the latest such turn
    whose context is the longest. Else, and where the template renders earlier turns otherwise once a
    later one follows, the context rendered afresh.
    """
    messages, best, size = context.messages, None, -1
    for k, (before, (text, _)) in enumerate(zip(t.contexts, t.replies)):
        n = len(before.messages)
        if (n >= size and before.tools == context.tools and len(messages) > n
                and messages[:n] == before.messages and messages[n].get("role") == "assistant"
                and messages[n].get("content") == text):
            best, size = k, n
    if best is not None:
        prompt, action = t.turn_ids(best)
        text, ended_with_eos = t.replies[best]
        try:
            return prompt + action + env.observation_ids(messages[:size], text, messages[size + 1:],
                                                         ended_with_eos, context.tools)
        except ValueError:
            pass
    return env.prompt_ids(messages, context.tools)


def to_step_contexts(t):
    """A trajectory of one growing row as step contexts (its environment gave a whole context): each turn's
    prompt is the row before it, the response its actions alone. assemble() gives the same row back."""
    if t.step_prompts:
        return
    spans, kept = t.turn_spans, [i for s, e in t.turn_spans for i in range(s, e)]
    t.step_prompts = [t.prompt_ids + t.response_ids[:s] for s, _ in spans]
    t.response_ids, t.action_mask, t.rollout_logprobs, t.versions = (
        [x[i] for i in kept] for x in (t.response_ids, t.action_mask, t.rollout_logprobs, t.versions))
    ends = [sum(e - s for s, e in spans[:k + 1]) for k in range(len(spans))]
    t.turn_spans = [(end - (e - s), end) for end, (s, e) in zip(ends, spans)]


def next_context(t, env, assistant, observation):
    """The Context of the next turn when the environment gave an observation to append: the last
    turn's context, the reply, the observation (a trajectory of step contexts, context=summary);
    context=last_k: the prompt's messages and the last keep_turns turns of the conversation."""
    if env.context == "last_k":
        return Context(env.step_messages(t.messages + [assistant] + observation, len(t.sample["messages"])),
                       t.contexts[-1].tools)
    last = t.contexts[-1]
    return Context(last.messages + [assistant] + observation, last.tools)


def observe(t, env, step, content, ended_with_eos, last_turn, cut, max_context_tokens):
    """
    Take a turn's step into the trajectory (step: its Future, ChatEnv.start). cut: None, or the
    finish reason of a turn the budget cut ("truncated" or "context_budget"). Returns True when the
    trajectory goes on, False when this ended it (module docstring). With context=summary, a next
    prompt over rollout.summary_tokens makes the next turn a summary (Trajectory.summarizing).
    """
    assistant = {"role": "assistant", "content": content}
    try:
        observation, reward, done, info = step.result()
    except Exception as e:  # the environment failed: this trajectory ends, no other
        t.messages.append(assistant)
        t.step_rewards.append(0.0)
        t.final_text = content
        return finish(t, "env_error", str(e))
    t.step_rewards.append(reward)
    for call in info.get("tool_calls", []):  # the turn of the trajectory's (summary turns count)
        call.turn = len(t.turn_spans) - 1
    t.tool_calls += info.get("tool_calls", [])
    if done or last_turn:
        t.messages.append(assistant)
        t.final_text = content
        if done and "step_rewards" in info:  # every turn's, known at the end (a flow's)
            if len(info["step_rewards"]) != len(t.turn_spans):
                return finish(t, "env_error", f"the environment gave {len(info['step_rewards'])} step "
                                              f"rewards for {len(t.turn_spans)} turns")
            t.step_rewards = [float(r) for r in info["step_rewards"]]
        if done and "outcome" in info:
            t.outcome = float(info["outcome"])
        # the budget's reason, unless the environment ended the episode without reading as far as the
        # cut (a game reads the first line of a reply): then what it judged was whole, and the outcome
        # is the environment's
        budget_ended = cut and (not done or info.get("read_to_end", True))
        return finish(t, cut if budget_ended else "done" if done else "max_turns")
    if isinstance(observation, Context):  # the environment decided the whole next context
        to_step_contexts(t)
        context, messages = observation, list(observation.messages)
    else:
        observation = [{**m, "content": env.truncate(m["content"], m["role"])} for m in observation]
        messages = t.messages + [assistant] + observation
        context = next_context(t, env, assistant, observation) if t.step_prompts else Context(messages)
    if not t.step_prompts:  # one growing row: the observation's ids appended
        obs_ids = env.observation_ids(t.messages, content, observation, ended_with_eos)
        next_length = len(t) + len(obs_ids)
    else:
        next_prompt = context_prompt_ids(t, env, context)
        if env.context == "summary" and len(next_prompt) > env.summary_tokens:
            request = {"role": "user", "content": SUMMARY_REQUEST}
            messages, context = messages + [request], Context(context.messages + [request], context.tools)
            next_prompt = context_prompt_ids(t, env, context)
            t.summarizing = True
        next_length = len(next_prompt)
    if next_length >= max_context_tokens:
        t.messages.append(assistant)
        t.final_text, t.summarizing = content, False
        return finish(t, "context_budget")
    if t.step_prompts:
        t.step_prompts.append(next_prompt)
    else:
        t.append(obs_ids, 0)
    t.contexts.append(context)
    t.messages = messages
    return True


def summarized(t, env, max_context_tokens):
    """
    After a summary turn (context=summary): the next turn's context is the prompt's messages, the
    summary, and the last turn before it (its reply and observation). Returns True when the trajectory
    goes on, False when that context is over the budget too.
    """
    summary, _ = t.replies[-1]
    t.summarizing, t.summaries = False, t.summaries + 1
    t.step_rewards.append(0.0)
    t.messages.append({"role": "assistant", "content": summary})
    asked = t.contexts[-1].messages[:-1]  # what was summarised, the request left out
    last = max(i for i, m in enumerate(asked) if m["role"] == "assistant")
    n_prompt = len(t.sample["messages"])
    summary_message = {"role": "user", "content": SUMMARY_HEADER + summary}
    context = Context(asked[:n_prompt] + [summary_message] + asked[last:], t.contexts[-1].tools)
    next_prompt = context_prompt_ids(t, env, context)
    if len(next_prompt) >= max_context_tokens:
        t.final_text = summary
        return finish(t, "context_budget")
    t.step_prompts.append(next_prompt)
    t.contexts.append(context)
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
            if not t.finish_reason:
                self.submit(t, 0)
        self.starts += 1
        return trajs

    def submit(self, t, turn):
        """Queue a trajectory's turn in the engine, from where a pause left it."""
        done_ids = t.partial[0]
        prompt = t.next_prompt_ids() + list(done_ids)
        tokens = min(self.sampling.max_new_tokens, t.contexts[-1].max_tokens or math.inf) - len(done_ids)
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
                    action_ids, prompt_tokens = list(ids) + gen.token_ids, len(t.next_prompt_ids())
                    content, ended_with_eos = take_turn(
                        t, action_ids, list(logprobs) + gen.logprobs, env.tokenizer,
                        list(versions) + [self.version] * len(gen.token_ids))
                    if t.summarizing:  # a summary turn: no environment step, the next turn sees the summary
                        if summarized(t, env, self.max_context_tokens):
                            self.submit(t, turn + 1)
                        continue
                    cut = (None if gen.finish_reason != "length"
                           else "context_budget" if budget < tokens else "truncated")
                    action = Action(content, gen.finish_reason, prompt_tokens, len(action_ids))
                    self.stepping[env.start(t.env, action)] = (t, turn, content, ended_with_eos, cut,
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
                last_turn = turn - t.summaries == self.max_turns - 1  # summaries do not count
                if observe(t, env, future, content, ended_with_eos, last_turn, cut, self.max_context_tokens):
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


def scripted_trajectories(env, samples, scripts, summarize=None):
    """
    Trajectories whose actions are given texts (demonstrations for a warm start), assembled as
    run_agent assembles sampled ones: the action ids are the text's tokens, + EOS unless the text
    ends with a stop tag (as the engine would have stopped), and the environments step for real,
    a turn's steps together (one batched search). scripts[i]: the assistant turn texts of
    samples[i]; a trajectory ends when its environment is done or its script is. With
    context=summary, summarize(row, messages) writes the summary a summary turn asks for (messages:
    what it summarises), which the script's turns do not count.
    """
    tokenizer = env.tokenizer
    trajs = start_trajectories(env, samples, max_context_tokens=float("inf"))
    turns = [0] * len(trajs)  # the next script turn of each trajectory
    while any(not t.finish_reason and k < len(script) for t, script, k in zip(trajs, scripts, turns)):
        stepping = {}  # step future -> (trajectory, content, ended with EOS)
        for i, (t, script) in enumerate(zip(trajs, scripts)):
            if t.finish_reason or turns[i] >= len(script):
                continue
            if t.summarizing:
                if summarize is None:
                    raise ValueError("a demonstration reached a summary turn (rollout.context=summary), but "
                                     "the task has no summarize(row, messages) to write it")
                summary = summarize(t.sample, t.contexts[-1].messages[:-1])
                take_turn(t, tokenizer.encode(summary, add_special_tokens=False) + [tokenizer.eos_token_id],
                          None, tokenizer)
                summarized(t, env, float("inf"))
                continue
            text = script[turns[i]]
            turns[i] += 1
            ids = tokenizer.encode(text, add_special_tokens=False)
            ids += [] if text.endswith(CALL_END) else [tokenizer.eos_token_id]
            content, ended_with_eos = take_turn(t, ids, None, tokenizer)
            step = env.start(t.env, Action(content, completion_tokens=len(ids)))
            stepping[step] = (t, content, ended_with_eos)
        wait(stepping, timeout=env.step_timeout_s)
        for future, (t, content, ended_with_eos) in stepping.items():
            env.expire(future)  # those not back by now (the others have their outcome already)
            observe(t, env, future, content, ended_with_eos, False, None, float("inf"))
    return trajs
