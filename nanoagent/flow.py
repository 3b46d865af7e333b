"""
Agent flows: an agent's own code, trained as it is written.

A task may give, instead of tools or an environment, a flow: a function (sync or async) that gets a
client and the data row, calls the model as often as it likes with messages it builds itself
(branches, sub-agents, a history it truncated, rewrote or summarised, its own tool execution), and
returns the outcome's reward, or (that reward, [a reward per call]):

    def flow(client, row):
        messages = list(row["messages"])
        for _ in range(4):
            reply = client.chat(messages, tools=SCHEMAS)     # a Reply: text, message, tool_calls
            messages.append(reply.message)
            if not reply.tool_calls:
                break
            messages += [{"role": "tool", "content": run(call)} for call in reply.tool_calls]
        return exact_match(reply.text, row["answers"])

An agent written against an OpenAI-compatible server instead is agent(base_url, row), and calls
nanoagent's endpoint at base_url with the openai package or any framework (endpoint.py).

Each model call is a turn of the trajectory: its context the call's messages and tools, rendered by
the chat template; its action the ids the engine sampled, with their logprobs and policy versions.
Where a call's messages go on from an earlier call's (its messages, its reply as it came, new
messages), the earlier call's ids are kept and only the new messages rendered, and the trainer
scores both calls in one growing row (agent.context_prompt_ids, Trajectory.assemble): a tool loop
written as a flow trains exactly as the tool environment does. Two calls from one prompt are two
rows that share it; a rewritten history starts a row of its own.

FlowEnv makes a flow an environment in env.py's sense, so the one agent loop runs flows too, with
its scheduling, partial rollouts, time limits and seeds: the flow runs in a thread of its own, and
each of its calls is the context that reset or a step returns; the loop samples it (the engine
batches every flow's calls with the other trajectories'), then steps with the reply, and the step
hands the reply to the flow and waits for its next call or its return. A flow's calls are served one
at a time, in the order it makes them (concurrent calls of one flow wait their turn; flows run side
by side). The time a flow spends between two calls is a step, under rollout.step_timeout_s; so is
the time to its first call. A flow that raises, returns something else or runs past the time ends
its own trajectory (env_error, the reason in the trajectory); rollout.max_turns bounds its calls.
When its trajectory ends, for whatever reason, its pending and later calls raise FlowStopped.
"""

import asyncio
import inspect
import os
import queue
import threading
import traceback
from concurrent.futures import Future
from dataclasses import dataclass

from nanoagent.env import Context, checked_context, finite
from nanoagent.tools import parse_tool_calls


class FlowStopped(RuntimeError):
    """The trajectory of a flow has ended (reason: its finish reason): its calls fail from then on."""

    def __init__(self, reason):
        super().__init__(f"the trajectory has ended ({reason}): no more model calls")
        self.reason = reason


@dataclass
class Reply:
    """The model's answer to a flow's call."""
    text: str                 # the assistant turn as sampled (a tool call's tags included, EOS not)
    finish_reason: str        # "stop": EOS or the end of a tool call; "length": a token budget cut it
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def message(self):
        """The assistant message to put in the history: a later call that goes on from it reuses its ids."""
        return {"role": "assistant", "content": self.text}

    @property
    def tool_calls(self):
        """The turn's tool calls (tools.ToolCall; error=True where one did not parse)."""
        return parse_tool_calls(self.text)


class Client:
    """What a flow calls the model with: chat() from a sync flow, achat() from an async one."""

    def __init__(self, flow):
        self.flow = flow

    def chat(self, messages, tools=None, max_tokens=None):
        """Sample an assistant turn for these messages (tools: schemas in the OpenAI format the chat
        template shows; max_tokens: at most rollout.max_new_tokens). Returns a Reply; raises FlowStopped
        once the trajectory has ended."""
        return self.flow.call(flow_context(messages, tools, max_tokens)).result()

    async def achat(self, messages, tools=None, max_tokens=None):
        return await asyncio.wrap_future(self.flow.call(flow_context(messages, tools, max_tokens)))


def flow_context(messages, tools, max_tokens):
    return checked_context({"messages": messages, "tools": tools, "max_tokens": max_tokens}, "the call")


class FlowEnv:
    """
    One trajectory's flow as an environment (module docstring). run(flow_env, row) runs the flow to its
    return, its calls going through flow_env.call (Client, or the endpoint for an agent); first_call_s:
    how long reset waits for the first call (rollout.step_timeout_s).
    """

    def __init__(self, run, first_call_s):
        self.run, self.first_call_s = run, first_call_s
        # ("call", Context, the Future of its Reply) | ("return", value) | ("raise", error)
        # | ("stopped", reason)
        self.events = queue.Queue()
        self.pending = None          # the Future of the call being sampled
        self.stopped = None          # the finish reason, once the trajectory has ended
        self.begun = False
        self.lock = threading.Lock()

    def call(self, context):
        """A model call of the flow: a Future of its Reply, which fails with FlowStopped once the
        trajectory has ended."""
        future = Future()
        with self.lock:
            if self.stopped:
                future.set_exception(FlowStopped(self.stopped))
            else:
                self.events.put(("call", context, future))
        return future

    def begin(self, row):
        """Start the flow (start_trajectories starts a batch's flows before it waits for any first call)."""
        threading.Thread(target=self.target, args=(row,), daemon=True).start()
        self.begun = True

    def reset(self, row):
        if not self.begun:
            self.begin(row)
        try:
            event = self.events.get(timeout=self.first_call_s)
        except queue.Empty:
            raise TimeoutError(f"the flow made no model call within {self.first_call_s:g}s "
                               "(rollout.step_timeout_s)") from None
        if event[0] == "return":
            raise RuntimeError("the flow returned before it called the model")
        return self.next_call(event)

    def step(self, action):
        self.pending.set_result(Reply(str(action), getattr(action, "finish_reason", "stop"),
                                      getattr(action, "prompt_tokens", 0),
                                      getattr(action, "completion_tokens", 0)))
        self.pending = None
        event = self.events.get()
        if event[0] == "return":
            outcome, rewards = flow_outcome(event[1])
            per_call = {"step_rewards": rewards} if rewards is not None else {}
            return [], 0.0, True, {"outcome": outcome, **per_call}
        return self.next_call(event), 0.0, False, {}

    def next_call(self, event):
        """The Context of the flow's next call (it is now the pending one); a flow that raised raises here."""
        if event[0] == "raise":
            raise FlowError(event[1])
        if event[0] == "stopped":
            raise FlowStopped(event[1])
        _, context, self.pending = event
        return context

    def target(self, row):
        try:
            self.events.put(("return", self.run(self, row)))
        except BaseException as e:  # a flow that calls sys.exit() has failed like any other
            self.events.put(("raise", e))

    def finish(self, reason):
        """The trajectory has ended: the pending call and those queued fail with FlowStopped, and so will
        later ones; a step still waiting (one past its time limit) wakes."""
        with self.lock:
            self.stopped = reason
            calls = [self.pending] if self.pending is not None else []
            while not self.events.empty():
                event = self.events.get_nowait()
                calls += [event[2]] if event[0] == "call" else []
            self.events.put(("stopped", reason))
        for future in calls:
            if not future.done():
                future.set_exception(FlowStopped(reason))


class FlowError(RuntimeError):
    """A flow raised: its trajectory ends (env_error) with the error and the line of the flow it came from."""

    def __init__(self, error):
        frames = traceback.extract_tb(error.__traceback__)
        where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
        said = f": {error}" if str(error) else ""
        super().__init__(f"the flow raised {type(error).__name__}{said}{where}")


def flow_outcome(value):
    """(the outcome's reward, a reward per call or None) of what a flow returned: a number, or (a number, a
    list of numbers)."""
    if finite(value):
        return float(value), None
    if (isinstance(value, tuple) and len(value) == 2 and finite(value[0])
            and isinstance(value[1], (list, tuple)) and all(map(finite, value[1]))):
        return float(value[0]), [float(r) for r in value[1]]
    raise TypeError(f"the flow returned {value!r:.80}, not a reward (a finite number) or (reward, "
                    "[a reward per call])")


def run_flow(flow, flow_env, row):
    """Run a task's flow(client, row), sync or async (an event loop of its own, in the flow's thread)."""
    result = flow(Client(flow_env), row)
    return asyncio.run(result) if inspect.iscoroutine(result) else result


def flow_env(flow, first_call_s):
    """A function that makes the FlowEnv of one trajectory of a task's flow (ChatEnv's make)."""
    return lambda: FlowEnv(lambda env, row: run_flow(flow, env, row), first_call_s)
