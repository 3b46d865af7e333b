"""
Tools and the tool environment.

A Tool is a name, a description, JSON-schema parameters and a function from arguments to text.
The model calls tools Hermes-style, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
the environment parses the call, checks the arguments against the schema, runs it under a time
limit (a daemon thread per call, never a process-wide signal; calls abandoned at the limit are
bounded per tool, see ToolEnv), truncates the result to a token budget counted where the result
lands in the observation, and renders it back with the tokenizer's chat template. Anything that
goes wrong — bad JSON, an unknown tool, bad arguments, anything the tool raises (SystemExit and
KeyboardInterrupt included), a time-out — becomes an error observation the model reads and can
recover from; it never crashes the rollout, and fails only the calls it concerns.

Observation tokens come from rendering only the new messages: the chat-template text that closes
the assistant turn, the tool turn, and the header of the next assistant turn, i.e. the suffix the
template adds after the assistant's content. The trajectory is then exactly what the template
would render for the same conversation.

Tool output is text, never conversation structure: a search result holding "<|im_end|>" must not
close the tool turn for the model. So the template is rendered with a marker in place of each tool
result and the ids are assembled as the tokenizer would make them (it cuts text at special tokens
and encodes each stretch between them on its own), except that special-token strings inside a
result stay ordinary text (encode_rendered). Everything that encodes tool text goes through it:
observations, the prompts of context=last_k, and the budget count of truncation.
"""

import ast
import functools
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

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TRUNCATION_MARK = "\n[truncated]"
TOOL_RESULT_MARKER = "\x00tool result\x00"  # rendered in place of each tool result, then split on (encode_rendered)


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict                                      # JSON schema of the arguments object
    call: Callable[[dict], str]                           # arguments -> result text
    call_batch: Callable[[list], list] | None = None      # all calls of a turn at once (e.g. batched search)

    def schema(self):
        """The tool as the chat template's `tools` list expects it (OpenAI function format)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


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
            calls.append(ToolCall(None, None, 'Error: malformed tool call, expected {"name": "<tool name>", "arguments": {...}}.', True))
            continue
        calls.append(ToolCall(obj["name"], args))
    if text.count("<tool_call>") > len(calls):
        calls.append(ToolCall(None, None, "Error: malformed tool call, <tool_call> was not closed with </tool_call>.", True))
    return calls


def _start(tool, arguments):
    """
    Start a tool on the arguments of some calls in a daemon thread: call_batch on all of them when
    the tool batches, else call on the one. Returns (thread, box); box gets "results" (one string per
    call) or "error" (what went wrong). Everything the tool raises is caught here, BaseException
    included: a tool that calls sys.exit() or raises KeyboardInterrupt has failed, and the model reads
    that like any other failure. No real Ctrl-C is swallowed: Python delivers signals to the main
    thread only, and no tool runs there. A call that never returns is abandoned at its time limit (a
    Python thread cannot be killed); being a daemon thread, it does not hold up process exit.
    """
    box = {}

    def target():
        try:
            results = tool.call_batch(arguments) if tool.call_batch is not None else [tool.call(arguments[0])]
            if not isinstance(results, (list, tuple)) or len(results) != len(arguments):
                got = f"{len(results)} results" if isinstance(results, (list, tuple)) else f"a {type(results).__name__}"
                box["error"] = f"returned {got} for {len(arguments)} calls."
            else:
                box["results"] = [str(r) for r in results]
        except BaseException as e:
            box["error"] = f"failed: {type(e).__name__}" + (f": {e}" if str(e) else "")

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


class ToolEnv:
    """
    Runs tool calls (execute, start), cuts their results to a token budget (truncate) and renders
    them as observation tokens (observation_ids), or with context=last_k renders what the next turn
    sees (step_prompt_ids).

    A call past its time limit is abandoned, not stopped: a Python thread cannot be killed, and the
    tools that matter here (search over an in-memory index and encoder) cannot move to a process that
    could be. So abandoned calls are bounded per tool instead: while `max_abandoned` earlier calls of a
    tool are still running past their limit, new calls to it fail at once with an error observation
    and start no thread. A tool that hangs for good then holds at most `max_abandoned` threads for the
    whole run (plus the calls in flight), rather than one more per call; a tool that was only slow
    serves again as soon as its abandoned calls end.
    """

    def __init__(self, tools, tokenizer, max_obs_tokens=512, timeout_s=10.0, context="full", keep_turns=2, workers=4, max_abandoned=8):
        if context not in ("full", "last_k") or keep_turns < 1:
            raise ValueError(f"context={context!r}, keep_turns={keep_turns}: context is full or last_k, keep_turns >= 1")
        self.tools = {t.name: t for t in tools}
        self.validators = {}  # tool name -> the validator of its arguments; the schema is checked once, here (a bad one: SchemaError)
        for t in tools:
            validator = jsonschema.validators.validator_for(t.parameters)
            validator.check_schema(t.parameters)
            self.validators[t.name] = validator(t.parameters)
        self.tokenizer = tokenizer
        self.context = context        # what a turn sees: the whole trajectory, or (last_k) the prompt and the last keep_turns turns
        self.keep_turns = keep_turns
        self.max_obs_tokens = max_obs_tokens
        self.timeout_s = timeout_s
        self.workers = workers
        self.max_abandoned = max_abandoned
        self.abandoned = {}           # tool name -> threads of its calls abandoned at their time limit
        self.lock = threading.Lock()  # guards abandoned: the background workers run execute concurrently
        self.waiting = queue.Queue()  # (calls, future) that start() handed to the background workers
        self.started = []             # the worker threads, started on first use

    def schemas(self):
        return [t.schema() for t in self.tools.values()]

    def run(self, calls):
        """Run tool calls now, in place (execute, then cut each result to max_obs_tokens)."""
        self.execute(calls)
        self.truncate_results(calls)
        return calls

    def start(self, calls):
        """
        Run tool calls in the background (execute only: the caller truncates the results with
        truncate_results once the returned Future is done, on its own thread, since the tokenizer
        is not safe to share between threads). A worker takes every call waiting at that moment,
        so a batching tool serves all of them at once (one search for every waiting query);
        several workers run, so a slow batch does not hold up the next.
        """
        future = Future()
        self.waiting.put((calls, future))
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
            except Exception as e:  # a bug in the environment itself: every waiting trajectory hears of it
                for _, future in jobs:
                    future.set_exception(e)
            else:
                for _, future in jobs:
                    future.set_result(None)

    def truncate_results(self, calls):
        for c in calls:
            if not c.error:
                c.result = self.truncate(c.result)

    def execute(self, calls):
        """
        Run tool calls in place: each ToolCall gets its result text (whole), error flag and
        duration. Calls to a tool with call_batch go to it as one batch; the others run in
        parallel threads. Each gets the environment's time limit, and a batch that fails or times
        out fails its own calls only. Uses no tokenizer.
        """
        jobs = []  # (thread, box, calls served, started)
        by_tool = {}
        for call in calls:
            if call.error:
                continue
            tool = self.tools.get(call.name)
            if tool is None:
                call.result, call.error = f"Error: unknown tool {call.name!r}; available tools: {', '.join(self.tools)}.", True
                continue
            error = jsonschema.exceptions.best_match(self.validators[call.name].iter_errors(call.arguments))
            if error is not None:  # what jsonschema.validate would raise, without checking the schema again (~1 ms a call)
                call.result, call.error = f"Error: bad arguments for {call.name}: {error.message}.", True
                continue
            by_tool.setdefault(tool.name, []).append(call)
        for name, group in by_tool.items():
            tool = self.tools[name]
            with self.lock:
                stuck = self.abandoned[name] = [t for t in self.abandoned.get(name, []) if t.is_alive()]
            if len(stuck) >= self.max_abandoned:
                for c in group:
                    c.result, c.error = (f"Error: tool {name} is not answering: {len(stuck)} earlier calls are still running "
                                         f"past the time limit of {self.timeout_s:g}s."), True
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

    def truncate(self, text):
        """
        Cut a tool result so that it costs at most max_obs_tokens tokens in its place in the
        observation, the truncation mark included (result_tokens). The cut falls where one of the
        text's tokens begins, which is always between two characters (the tokens of a character
        made of several share its start), so no character is split and no U+FFFD appears. One
        encode of the text with offsets finds those places; the longest prefix that fits is found by
        trying them from about the budget down, a few encodes of about the budget's length.
        """
        if self.result_tokens(text) <= self.max_obs_tokens:
            return text
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True)
        starts = sorted({s for s, _ in enc["offset_mapping"] if 0 < s < len(text)})
        for n in reversed(starts[:self.max_obs_tokens]):  # text[:starts[k]] holds about k + 1 tokens
            if self.result_tokens(text[:n] + TRUNCATION_MARK) <= self.max_obs_tokens:
                return text[:n] + TRUNCATION_MARK
        return TRUNCATION_MARK if self.result_tokens(TRUNCATION_MARK) <= self.max_obs_tokens else ""

    def result_tokens(self, text):
        """
        The tokens `text` adds to an observation as a tool result: the chat template's text around a
        tool message, encoded with it minus without it. A result alone would be miscounted, since
        merges span its edges (".\n" is one Qwen token, the "\n" being the template's).
        """
        framed, alone = self._result_frame
        return len(self.encode_rendered(framed, [text])) - alone

    @functools.cached_property
    def _result_frame(self):
        """(a short conversation ending in one tool result, rendered with the marker in its place;
        the tokens of that conversation without the result), rendered once."""
        framed = self.tokenizer.apply_chat_template([{"role": "user", "content": "?"}, {"role": "assistant", "content": "?"},
                                                     {"role": "tool", "content": TOOL_RESULT_MARKER}], tokenize=False,
                                                    add_generation_prompt=True)
        return framed, len(self.encode_rendered(framed, [""]))

    @functools.cached_property
    def _special_tokens(self):
        """A regex of the tokenizer's special tokens, longest first (where two start at one place the
        tokenizer takes the longer), in a group so that re.split keeps them."""
        specials = sorted((t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special), key=len, reverse=True)
        if not specials:
            raise ValueError("the tokenizer has no special tokens; a chat template needs at least its end-of-turn token")
        return re.compile("(" + "|".join(map(re.escape, specials)) + ")")

    def encode_rendered(self, text, results):
        """
        The ids of template text rendered with TOOL_RESULT_MARKER in place of each of `results`, the
        results put back as text. The tokenizer cuts a text at its special tokens and encodes each
        stretch in between on its own; this does the same with the template's special tokens only,
        and encodes the stretches with split_special_tokens, so a special token's string inside a
        result becomes ordinary tokens. Without such strings the ids are exactly encode(text with the
        results), merges across a result's edges included.
        """
        pieces = text.split(TOOL_RESULT_MARKER)
        if len(pieces) != len(results) + 1:
            raise ValueError(f"the chat template rendered {len(pieces) - 1} of {len(results)} tool results verbatim; "
                             "nanoagent needs a template that renders tool results as they are")
        stretches, specials = [""], []  # text between the template's special tokens, and those tokens
        for k, piece in enumerate(pieces):
            parts = self._special_tokens.split(piece)  # text, special, text, ..., text
            stretches[-1] += parts[0]
            for special, after in zip(parts[1::2], parts[2::2]):
                specials.append(special)
                stretches.append(after)
            if k < len(results):
                stretches[-1] += results[k]
        encoded = self.tokenizer(stretches, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        ids = encoded[0]
        for special, stretch in zip(specials, encoded[1:]):
            ids = ids + [self.tokenizer.convert_tokens_to_ids(special)] + stretch
        return ids

    def render(self, messages, add_generation_prompt=False):
        return self.tokenizer.apply_chat_template(messages, tools=self.schemas() or None, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def prompt_ids(self, messages):
        """The ids of a conversation and the next assistant header, its tool results as text."""
        text = self.render(marked(messages), add_generation_prompt=True)
        return self.encode_rendered(text, [m["content"] for m in messages if m["role"] == "tool"])

    def prompt_lengths(self, conversations):
        """len(prompt_ids(m)) for many conversations, with one batched encode (a prompt file at once)
        of those without tool results, which encode_rendered would encode the same."""
        texts = [self.render(m, add_generation_prompt=True) for m in conversations]
        lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        return [len(self.prompt_ids(m)) if any(x["role"] == "tool" for x in m) else n for m, n in zip(conversations, lengths)]

    def observation_ids(self, messages, content, tool_results, ended_with_eos=False):
        """
        The ids the environment appends after an assistant turn whose text is `content` (the
        decoded action, stop tag included, EOS excluded): the template's closing glue of that turn,
        one tool message per result, and the next assistant header. `messages` is the conversation
        before the assistant turn; returns (ids, new messages to append to the conversation).
        When the model sampled EOS itself, that token is already the start of the closing glue.
        The results are rendered as markers and encoded as text (encode_rendered).
        """
        messages = marked(messages)
        before = self.render(messages, add_generation_prompt=True)
        assistant = {"role": "assistant", "content": content}
        with_turn = self.render(messages + [assistant])
        if not with_turn.startswith(before + content):
            raise ValueError("the chat template does not render assistant content verbatim after the generation "
                             "prompt; token-in/token-out trajectories need a template that does")
        after = self.render(messages + turn_messages(content, [TOOL_RESULT_MARKER] * len(tool_results)), add_generation_prompt=True)
        if not after.startswith(with_turn):
            raise ValueError("the chat template re-renders earlier turns when tool messages are added")
        text = with_turn[len(before + content):] + after[len(with_turn):]
        if ended_with_eos:
            if not text.startswith(self.tokenizer.eos_token):
                raise ValueError("the chat template does not close an assistant turn with the EOS token")
            text = text[len(self.tokenizer.eos_token):]
        return self.encode_rendered(text, tool_results), turn_messages(content, tool_results)

    def step_messages(self, messages, n_prompt):
        """
        What the next turn sees of a conversation under context=last_k: its first n_prompt messages
        (the system prompt and the question) and its last keep_turns turns, a turn being an assistant
        message with the tool results that answered it. Older turns are left out whole.
        """
        starts = [i for i in range(n_prompt, len(messages)) if messages[i]["role"] == "assistant"]
        first = starts[-self.keep_turns] if len(starts) > self.keep_turns else n_prompt
        return messages[:n_prompt] + messages[first:]

    def step_prompt_ids(self, messages, n_prompt):
        """The prompt ids of the next turn under context=last_k, rendered afresh (step_messages)."""
        return self.prompt_ids(self.step_messages(messages, n_prompt))


def turn_messages(content, tool_results):
    """The messages one turn adds to a conversation: the assistant's, then one per tool result."""
    return [{"role": "assistant", "content": content}] + [{"role": "tool", "content": r} for r in tool_results]


def marked(messages):
    """The conversation with TOOL_RESULT_MARKER in place of each tool result (see encode_rendered)."""
    return [{**m, "content": TOOL_RESULT_MARKER} if m["role"] == "tool" else m for m in messages]


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
        parameters={"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 12"}},
                    "required": ["expression"], "additionalProperties": False},
        call=lambda args: calculate(args["expression"]),
    )


def format_passages(passages):
    """Compact search results: one line of title and text per passage."""
    return "\n".join(f"Doc {i + 1} (Title: {p['title']}) {p['text']}" for i, p in enumerate(passages)) or "No results."


def search_tool(retriever, top_k=3):
    """`search` over a retriever (anything with search(queries, k) -> passages per query); all
    the calls of a turn go to the retriever, hence to the encoder, as one batch."""
    def call_batch(arguments):
        return [format_passages(hits) for hits in retriever.search([a["query"] for a in arguments], top_k)]

    return Tool(
        name="search",
        description="Search Wikipedia passages. Returns the most relevant passages with their titles.",
        parameters={"type": "object", "properties": {"query": {"type": "string", "description": "the search query"}},
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
                raise ValueError("the search tool needs an index folder: build one with build_index.py and pass it "
                                 "(data.index_dir=DIR for train.py, --index DIR for rollout.py)")
            from nanoagent.retriever import IndexRetriever
            tools.append(search_tool(IndexRetriever(index_dir, encoder), top_k))
        else:
            raise ValueError(f"unknown tool {name!r}; built-in tools: calculator, search")
    return tools
