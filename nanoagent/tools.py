"""
Tools, and tool calling as an environment.

A Tool is a name, a description, JSON-schema parameters and a function from arguments to text.
The model calls tools Hermes-style, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
ToolCalling, the environment of a tool task (env.py says what an environment is), parses a turn's
calls and has a ToolRunner run them: the arguments checked against the schema, each call under a
time limit (a daemon thread per call, never a process-wide signal; abandoned calls are bounded per
tool, see ToolRunner). Anything that goes wrong (bad JSON, an unknown tool, bad arguments, anything
the tool raises, SystemExit and KeyboardInterrupt included, a time-out) becomes an error
observation the model reads and can recover from; it never crashes the rollout, and fails only the
calls it concerns.
"""

import ast
import json
import math
import operator
import queue
import re
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import jsonschema

from nanoagent.keys import ConfigError

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
CALL_END = "</tool_call>"  # a turn that calls tools ends here: the engines stop on it (engine.stop_strings)

# nanoagent's tool format for chat templates without one (rollout.tool_format=hermes): Qwen2.5's own wording,
# at the end of the system turn, one tool schema per line
HERMES_TOOLS = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                "<tools>\n{}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n"
                '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict                                      # JSON schema of the arguments object
    call: Callable[[dict], str]                           # arguments -> result text
    call_batch: Callable[[list], list] | None = None      # all calls of a turn at once (e.g. batched search)

    def schema(self):
        """The tool as the chat template's `tools` list expects it (OpenAI function format)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class ToolCall:
    name: str | None      # None when the call could not be parsed
    arguments: dict | None
    result: str = ""      # the text the model sees (an error message when error)
    error: bool = False
    seconds: float = 0.0
    turn: int = 0         # the assistant turn it was made in (set by the agent loop)


def parse_tool_calls(text):
    """
    Every tool call in an action's text, in order. A call that is not a JSON object with a string
    "name" and an object "arguments" comes back as a ToolCall with error=True and the reason.
    An opening tag without a closing one (the turn ran out of tokens) is an error too.
    """
    calls = []
    for body in TOOL_CALL_RE.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, None, f"Error: malformed tool call, invalid JSON ({e}). "
                                  'Write <tool_call>{"name": "...", "arguments": {...}}</tool_call>.', True))
            continue
        args = obj.get("arguments") if isinstance(obj, dict) else None
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            calls.append(ToolCall(None, None, 'Error: malformed tool call, expected '
                                  '{"name": "<tool name>", "arguments": {...}}.', True))
            continue
        calls.append(ToolCall(obj["name"], args))
    if text.count("<tool_call>") > len(calls):
        calls.append(ToolCall(None, None, "Error: malformed tool call, "
                              "<tool_call> was not closed with </tool_call>.", True))
    return calls


def hermes_messages(messages, schemas):
    """
    A conversation in nanoagent's fallback tool format, as plain system/user/assistant messages that
    any chat template renders (Qwen2.5's Hermes format, which its template makes from tools= and tool
    messages): the tools' block ends the system turn (or is one, when the conversation has none), and
    each run of tool messages becomes one user turn of <tool_response> blocks. Assistant turns hold
    their <tool_call> text already (the model wrote it).
    """
    block = HERMES_TOOLS.format("\n".join(json.dumps(s, ensure_ascii=False) for s in schemas))
    has_system = bool(messages) and messages[0]["role"] == "system"
    out = [{"role": "system", "content": messages[0]["content"] + "\n\n" + block if has_system else block}]
    after_tool = False  # the last message was a tool result: the next one joins its user turn
    for m in messages[1:] if has_system else messages:
        if m["role"] != "tool":
            out.append(m)
        else:
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if after_tool:
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + response}
            else:
                out.append({"role": "user", "content": response})
        after_tool = m["role"] == "tool"
    return out


def _start(tool, arguments):
    """
    Start a tool on the arguments of some calls in a daemon thread: call_batch on all of them when
    the tool batches, else call on the one. Returns (thread, box); box gets "results" (one string per
    call) or "error". Everything the tool raises is caught, BaseException included: a tool that calls
    sys.exit() or raises KeyboardInterrupt has failed like any other (no real Ctrl-C is swallowed:
    Python delivers signals to the main thread only, and no tool runs there). A call that never
    returns is abandoned at its time limit (a Python thread cannot be killed); a daemon thread does
    not hold up process exit.
    """
    box = {}

    def target():
        try:
            results = tool.call_batch(arguments) if tool.call_batch is not None else [tool.call(arguments[0])]
            if not isinstance(results, (list, tuple)) or len(results) != len(arguments):
                got = (f"{len(results)} results" if isinstance(results, (list, tuple))
                       else f"a {type(results).__name__}")
                box["error"] = f"returned {got} for {len(arguments)} calls."
            else:
                box["results"] = [str(r) for r in results]
        except BaseException as e:
            box["error"] = f"failed: {type(e).__name__}" + (f": {e}" if str(e) else "")

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


class ToolCalling:
    """
    The environment of one trajectory of a tool task (Agent-R1's ToolEnv): each step runs the
    turn's tool calls (info["tool_calls"], each with its turn) and answers with one tool message per
    call; a turn without a call is the answer, and ends the episode. A step's reward is 0: what a
    successful call is worth is the trainer's to say (train.tool_call_reward).
    """

    def __init__(self, runner):
        self.runner = runner
        self.turn = 0

    def reset(self, row):
        return row["messages"]

    def step(self, action):
        calls = parse_tool_calls(action)
        for c in calls:
            c.turn = self.turn
        self.turn += 1
        if not calls:
            return [], 0.0, True, {"tool_calls": []}
        self.runner.start(calls).result()  # raises the runner's own bug, if any: this trajectory fails
        return [{"role": "tool", "content": c.result} for c in calls], 0.0, False, {"tool_calls": calls}


class ToolRunner:
    """
    Runs tool calls, now (run) or in the background (start), for every trajectory of a rollout.

    A call past its time limit is abandoned, not stopped: a Python thread cannot be killed, and the
    tools that matter here (search over an in-memory index and encoder) cannot move to a process
    that could be. So abandoned calls are bounded per tool: while `max_abandoned` earlier calls of a
    tool still run past their limit, new calls to it fail at once with an error observation and
    start no thread. A tool that hangs for good holds at most `max_abandoned` threads for the whole
    run (plus the calls in flight), not one more per call; one that was only slow serves again as
    soon as its abandoned calls end.
    """

    def __init__(self, tools, timeout_s=10.0, workers=4, max_abandoned=8):
        self.tools = {t.name: t for t in tools}
        # tool name -> the validator of its arguments; each schema is checked once, here (bad: SchemaError)
        self.validators = {}
        for t in tools:
            validator = jsonschema.validators.validator_for(t.parameters)
            validator.check_schema(t.parameters)
            self.validators[t.name] = validator(t.parameters)
        self.timeout_s = timeout_s
        self.workers = workers
        self.max_abandoned = max_abandoned
        self.abandoned = {}           # tool name -> threads of its calls abandoned at their time limit
        self.lock = threading.Lock()  # guards abandoned and started: execute and start run on many threads
        self.waiting = queue.Queue()  # (calls, future) that start() handed to the background workers
        self.started = []             # the worker threads, started on first use

    def schemas(self):
        return [t.schema() for t in self.tools.values()]

    def run(self, calls):
        """Run tool calls now, in place (execute)."""
        return self.execute(calls)

    def start(self, calls):
        """
        Run tool calls in the background; returns a Future that is done when they are. A worker
        takes every call waiting at that moment, so a batching tool serves all of them at once (one
        search for the queries of every trajectory waiting); several workers run, so a slow batch
        does not hold up the next.
        """
        future = Future()
        self.waiting.put((calls, future))
        with self.lock:
            while len(self.started) < self.workers:
                self.started.append(threading.Thread(target=self._serve, daemon=True))
                self.started[-1].start()
        return future

    def _serve(self):
        while True:
            jobs = [self.waiting.get()]
            # Take what else is waiting without blocking: between an empty() check and a get() another
            # worker can take the last job, and a blocking get() would then sit on the jobs already taken.
            while True:
                try:
                    jobs.append(self.waiting.get_nowait())
                except queue.Empty:
                    break
            try:
                self.execute([c for calls, _ in jobs for c in calls])
            except Exception as e:  # a bug in the runner itself: every waiting trajectory hears of it
                for _, future in jobs:
                    future.set_exception(e)
            else:
                for _, future in jobs:
                    future.set_result(None)

    def execute(self, calls):
        """
        Run tool calls in place: each ToolCall gets its result text (whole), error flag and
        duration. Calls to a tool with call_batch go to it as one batch; the others run in
        parallel threads. Each gets the environment's time limit, and a batch that fails or times
        out fails its own calls only.
        """
        jobs = []  # (thread, box, calls served, started)
        by_tool = {}
        for call in calls:
            if call.error:
                continue
            tool = self.tools.get(call.name)
            if tool is None:
                call.result, call.error = (f"Error: unknown tool {call.name!r}; "
                                           f"available tools: {', '.join(self.tools)}."), True
                continue
            error = jsonschema.exceptions.best_match(self.validators[call.name].iter_errors(call.arguments))
            # what jsonschema.validate would raise, without checking the schema again (~1 ms a call)
            if error is not None:
                call.result, call.error = f"Error: bad arguments for {call.name}: {error.message}.", True
                continue
            by_tool.setdefault(tool.name, []).append(call)
        for name, group in by_tool.items():
            tool = self.tools[name]
            with self.lock:
                stuck = self.abandoned[name] = [t for t in self.abandoned.get(name, []) if t.is_alive()]
            if len(stuck) >= self.max_abandoned:
                for c in group:
                    c.result, c.error = (
                        f"Error: tool {name} is not answering: {len(stuck)} earlier calls are still "
                        f"running past the time limit of {self.timeout_s:g}s."), True
            elif tool.call_batch is not None:
                thread, box = _start(tool, [c.arguments for c in group])
                jobs.append((thread, box, group, time.perf_counter()))
            else:
                for c in group:
                    thread, box = _start(tool, [c.arguments])
                    jobs.append((thread, box, [c], time.perf_counter()))
        for thread, box, served, started in jobs:
            thread.join(max(0.0, started + self.timeout_s - time.perf_counter()))
            seconds = time.perf_counter() - started
            name = served[0].name
            if thread.is_alive():
                with self.lock:
                    self.abandoned.setdefault(name, []).append(thread)
                results, error = None, f"Error: tool {name} timed out after {self.timeout_s:g}s."
            elif "error" in box:
                results, error = None, f"Error: tool {name} {box['error']}"
            else:
                results, error = box["results"], None
            for i, c in enumerate(served):
                c.seconds = seconds
                if error is not None:
                    c.result, c.error = error, True
                else:
                    c.result = results[i]
        return calls

# -----------------------------------------------------------------------------
# built-in tools

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression):
    """Arithmetic on numbers with + - * / // % ** and parentheses, by walking Python's parse tree:
    anything else (names, calls, attributes) is refused, so no code can run."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
                raise ValueError("exponent too large")
            return _BINARY[type(node.op)](left, right)
        raise ValueError(f"unsupported expression element: {type(node).__name__}")

    try:
        value = ev(ast.parse(expression.strip(), mode="eval"))
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("result is not finite")
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.10g}"
    return str(value)


def calculator_tool():
    return Tool(
        name="calculator",
        description="Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        parameters={"type": "object",
                    "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 12"}},
                    "required": ["expression"], "additionalProperties": False},
        call=lambda args: calculate(args["expression"]),
    )


def format_passages(passages):
    """Compact search results: one line of title and text per passage."""
    return ("\n".join(f"Doc {i + 1} (Title: {p['title']}) {p['text']}" for i, p in enumerate(passages))
            or "No results.")


def search_tool(retriever, top_k=3):
    """`search` over a retriever (anything with search(queries, k) -> passages per query); all
    the calls of a turn go to the retriever, hence to the encoder, as one batch."""
    def call_batch(arguments):
        return [format_passages(hits) for hits in retriever.search([a["query"] for a in arguments], top_k)]

    return Tool(
        name="search",
        description="Search Wikipedia passages. Returns the most relevant passages with their titles.",
        parameters={"type": "object",
                    "properties": {"query": {"type": "string", "description": "the search query"}},
                    "required": ["query"], "additionalProperties": False},
        call=lambda args: call_batch([args])[0],
        call_batch=call_batch,
    )


def make_tools(names, index_dir=None, encoder=None, top_k=3):
    """The tools a task uses, by name: "calculator", "search" (over an index folder from build_index.py;
    encoder None: the one the index records)."""
    tools = []
    for name in names:
        if name == "calculator":
            tools.append(calculator_tool())
        elif name == "search":
            if not index_dir:
                raise ValueError("the search tool needs an index folder: build one with build_index.py and "
                                 "pass it (task.index_dir=DIR for train.py, --index DIR for rollout.py)")
            from nanoagent.retriever import IndexRetriever
            try:
                retriever = IndexRetriever(index_dir, encoder)
            except (OSError, ValueError) as e:  # no index there, a build not finished, another encoder's
                raise ConfigError(str(e)) from None  # one line, as train.py prints a setting's error
            tools.append(search_tool(retriever, top_k))
        else:
            raise ValueError(f"unknown tool {name!r}; built-in tools: calculator, search")
    return tools
