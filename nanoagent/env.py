"""
Environments: what an agent acts in, turn by turn, and how what it reads becomes tokens.

An environment is made per trajectory and needs no base class, only two methods (Agent-R1's
AgentEnv, gym's reset/step):

    reset(row)   -> messages: the conversation the trajectory starts from, chat format (the system
                    prompt and the task as the model first reads it; a tool task: row["messages"]);
                    or a context (below)
    step(action) -> (observation, reward, done, info), after the assistant turn whose text is
                    `action` (decoded, stop tag included, EOS not; an Action, a str that also says
                    how the engine ended the turn):
        observation  what the model reads next, appended to what it read before: a list of chat
                     messages (a tool task: one "tool" message per call), or a string (one "user"
                     message); or, in place of that, the whole next context: a dict {"messages":
                     [...], "tools": [schemas] (optional: the task's), "max_tokens": n (optional)},
                     which the environment decides (history truncated, summarised, rewritten,
                     augmented; a flow's next model call, flow.py); not read when done
        reward       a float for this step, put on the last token of the turn (like a process
                     reward); the task's score gives the outcome
        done         True when the episode is over (a tool task: the model answered without a call)
        info         a dict; its "tool_calls" are kept on the trajectory (reward.py, metrics);
                     "read_to_end": False when the environment acted on a part of the action and
                     did not read its end (a game reads the first line): a turn cut by the token
                     budget after that part was judged whole (agent.py: it ends as "done", not
                     "truncated"); on the last step, "outcome": the episode's reward, when the
                     environment knows it (a flow's return; the task's score may use it), and
                     "step_rewards": every turn's reward, in place of those given step by step
    finish(reason)  optional: called once when the trajectory ends, with its finish reason (a flow's
                    calls then fail with it)

Tool calling is one such environment (tools.ToolCalling, made by tool_env below), a game another
(tasks/textworld.py). A step runs in a thread of its own while the engine keeps decoding other
trajectories (ChatEnv.start); a step that raises, returns something that is not the above (a NaN
reward, say) or outlasts rollout.step_timeout_s ends its own trajectory ("env_error") and no other.

ChatEnv is the side every environment shares: it makes one per trajectory, runs their steps, and
turns conversations into ids with the tokenizer's chat template (observation_ids; with
context=last_k, step_prompt_ids), each observation cut to a token budget (truncate). A context
(messages, tools) renders under its own tools; where a context goes on from an earlier turn's, the
ids of that turn are kept and only what follows is rendered (agent.py: context_prompt_ids).

Environment text is text, never conversation structure: a search result or a game's text holding
"<|im_end|>" must not close its turn for the model. So the template is rendered with a marker in
place of the content of every message that is not the system's or the assistant's, and the ids are
assembled as the tokenizer would make them (cut at special tokens, each stretch between them
encoded on its own), except that special-token strings inside that content stay ordinary text
(encode_rendered). Prompts, observations and truncation's token count all go through it.
"""

import functools
import math
import re
import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

from nanoagent.config import ConfigError
from nanoagent.tools import CALL_END, ToolCalling, ToolRunner, hermes_messages

TRUNCATION_MARK = "\n[truncated]"
TEXT_MARKER = "\x00environment text\x00"  # in place of environment text, then split on (encode_rendered)
TEXT_ROLES = ("system", "assistant")      # the roles whose content is rendered as is; any other's is text
CONTEXTS = ("full", "last_k", "summary")  # rollout.context


@dataclass
class Context:
    """What a turn is sampled from, when the environment gives it whole (reset, or a step's dict
    observation): the conversation, the tools shown (None: the task's) and the turn's budget of new
    tokens (None: rollout.max_new_tokens)."""
    messages: list
    tools: list | None = None
    max_tokens: int | None = None


class Action(str):
    """A turn's text as an environment steps on it (a str: decoded, stop tag included, EOS not), with
    how the engine ended it: finish_reason "stop" (EOS or a stop tag) or "length" (a budget), and the
    tokens of its prompt and of the action (a flow's reply, an endpoint's usage)."""

    def __new__(cls, text, finish_reason="stop", prompt_tokens=0, completion_tokens=0):
        action = super().__new__(cls, text)
        action.finish_reason, action.prompt_tokens, action.completion_tokens = (finish_reason, prompt_tokens,
                                                                                completion_tokens)
        return action


class ChatEnv:
    """
    Environments for a task's trajectories (make: () -> a new environment), their steps in the
    background (start), and the conversations rendered as ids under one tokenizer and chat template.
    schemas: the tools the template lists in the system turn (a tool task's; none for a game).
    context: what a turn sees, the whole trajectory ("full"), the prompt and the last keep_turns
    turns ("last_k"), or the whole trajectory until it passes summary_tokens, then the prompt, the
    model's summary of the rest and the last turn ("summary", agent.py); max_obs_tokens: the budget
    of each observation message. tool_format: how the
    tools and their results are shown (rollout.tool_format): "template", by the chat template's own
    tools= and tool messages; "hermes", nanoagent's fallback (tools.hermes_messages), for templates
    without tools; "auto", the template's when it renders tools=, else hermes.
    """

    def __init__(self, make, tokenizer, schemas=(), max_obs_tokens=512, context="full", keep_turns=2,
                 step_timeout_s=120.0, tool_format="auto", summary_tokens=0):
        if context not in CONTEXTS or keep_turns < 1 or (context == "summary" and summary_tokens < 1):
            raise ValueError(f"context={context!r}, keep_turns={keep_turns}, "
                             f"summary_tokens={summary_tokens}: context is one of {', '.join(CONTEXTS)}, "
                             "keep_turns >= 1, summary_tokens >= 1 with context=summary")
        self.make = make
        self.tokenizer = tokenizer
        self.schemas = list(schemas)
        self.tool_format = tool_format
        # no template at all: check() refuses it
        if tool_format == "template" and self.schemas and tokenizer.chat_template and not self.template_tools:
            raise ConfigError("rollout.tool_format=template, but the model's chat template ignores tools= "
                              "(it renders the same text with and without them): the model would never see "
                              "its tools. Use rollout.tool_format=hermes (or auto), nanoagent's fallback "
                              "tool format (docs/recipes.md: Models and chat templates)")
        self.hermes = self.renders_hermes(self.schemas)
        self.max_obs_tokens = max_obs_tokens
        self.context = context
        self.keep_turns = keep_turns
        self.summary_tokens = summary_tokens
        self.step_timeout_s = step_timeout_s
        self.frames = {}  # role -> _frame(role)
        self.endpoint = None  # the OpenAI-compatible endpoint its trajectories' agents call (endpoint.py)

    @functools.cached_property
    def template_tools(self):
        """Whether the chat template renders a tools= list (a template without tools ignores it)."""
        return bool(self.tokenizer.chat_template) and template_shows_tools(self.tokenizer)

    def renders_hermes(self, schemas):
        """Whether these tools are shown in nanoagent's fallback format (tool_format hermes, or auto with a
        template that ignores tools=)."""
        return bool(schemas) and (self.tool_format == "hermes" or not self.template_tools)

    def close(self):
        """Stop what the environments share that outlives a rollout: the endpoint, if there is one."""
        if self.endpoint is not None:
            self.endpoint.stop()

    def start(self, env, action):
        """
        env.step(action) in a daemon thread of its own (a step that never returns does not hold up the
        process's exit). Returns a Future of the checked (observation messages, reward, done, info);
        it raises StepError with the reason when the step raised (anything, BaseException included:
        an environment that calls sys.exit() has failed), returned something else, or was expired.
        """
        future = Future()

        def target():
            try:
                outcome = checked_step(env.step(action))
            except BaseException as e:
                outcome = StepError(f"{type(e).__name__}" + (f": {e}" if str(e) else ""))
            settle(future, outcome)

        threading.Thread(target=target, daemon=True).start()
        return future

    def expire(self, future):
        """Fail a step that ran past step_timeout_s. Its thread is abandoned, not stopped (a Python thread
        cannot be killed); whatever it returns later is dropped."""
        settle(future, StepError(f"the step did not return within {self.step_timeout_s:g}s "
                                 "(rollout.step_timeout_s)"))

    def truncate(self, text, role="tool"):
        """
        Cut an observation so that it costs at most max_obs_tokens tokens in its place in the
        conversation (a message of `role`), the truncation mark included (observation_tokens). The
        cut falls where one of the text's tokens begins, always between two characters (the tokens
        of a character made of several share its start): no character is split, no U+FFFD appears.
        The longest prefix that fits is found by trying those places from about the budget down: a
        few encodes of about the budget's length, not one per place.
        """
        if self.observation_tokens(text, role) <= self.max_obs_tokens:
            return text
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True,
                             split_special_tokens=True)
        starts = sorted({s for s, _ in enc["offset_mapping"] if 0 < s < len(text)})
        for n in reversed(starts[:self.max_obs_tokens]):  # text[:starts[k]] holds about k + 1 tokens
            if self.observation_tokens(text[:n] + TRUNCATION_MARK, role) <= self.max_obs_tokens:
                return text[:n] + TRUNCATION_MARK
        return (TRUNCATION_MARK if self.observation_tokens(TRUNCATION_MARK, role) <= self.max_obs_tokens
                else "")

    def observation_tokens(self, text, role="tool"):
        """
        The tokens `text` adds to a conversation as the content of a message of `role`: the chat
        template's text around such a message, encoded with it minus without it. The text alone
        would be miscounted, since merges span its edges (".\\n" is one Qwen token, the "\\n" being
        the template's).
        """
        framed, alone = self._frame(role)
        return len(self.encode_rendered(framed, [text])) - alone

    def _frame(self, role):
        """(a short conversation ending in one message of `role`, rendered with the marker in place
        of its content; the number of tokens of that conversation without the content), once per role."""
        if role in self.frames:
            return self.frames[role]
        framed = self.render([{"role": "user", "content": "?"}, {"role": "assistant", "content": "?"},
                              {"role": role, "content": TEXT_MARKER}], add_generation_prompt=True)
        # e.g. "?" of the user message, were it environment text: it is not marked here
        if framed.count(TEXT_MARKER) != 1:
            raise ValueError(f"the chat template does not render a {role!r} message's content verbatim")
        self.frames[role] = framed, len(self.encode_rendered(framed, [""]))
        return self.frames[role]

    @functools.cached_property
    def _special_tokens(self):
        """A regex of the tokenizer's special tokens, longest first (where two start at one place the
        tokenizer takes the longer), in a group so that re.split keeps them."""
        specials = sorted((t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special),
                          key=len, reverse=True)
        if not specials:
            raise ValueError("the tokenizer has no special tokens; "
                             "a chat template needs at least its end-of-turn token")
        return re.compile("(" + "|".join(map(re.escape, specials)) + ")")

    def encode_rendered(self, text, texts):
        """
        The ids of template text rendered with TEXT_MARKER in place of each of `texts`, those put back
        as text. The tokenizer cuts a text at its special tokens and encodes each stretch in between
        on its own; this does the same with the template's special tokens only, and encodes the
        stretches with split_special_tokens, so a special token's string inside an environment text
        becomes ordinary tokens. Without such strings the ids are exactly encode(text with the
        texts), merges across their edges included.
        """
        pieces = text.split(TEXT_MARKER)
        if len(pieces) != len(texts) + 1:
            raise ValueError(f"the chat template rendered {len(pieces) - 1} of {len(texts)} messages "
                             "verbatim; nanoagent needs a template that renders message content as it is")
        stretches, specials = [""], []  # text between the template's special tokens, and those tokens
        for k, piece in enumerate(pieces):
            parts = self._special_tokens.split(piece)  # text, special, text, ..., text
            stretches[-1] += parts[0]
            for special, after in zip(parts[1::2], parts[2::2]):
                specials.append(special)
                stretches.append(after)
            if k < len(texts):
                stretches[-1] += texts[k]
        encoded = self.tokenizer(stretches, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        ids = encoded[0]
        for special, stretch in zip(specials, encoded[1:]):
            ids = ids + [self.tokenizer.convert_tokens_to_ids(special)] + stretch
        return ids

    def render(self, messages, add_generation_prompt=False, tools=None):
        """The template's text of a conversation, under the task's tools or (tools) a context's own."""
        schemas = self.schemas if tools is None else tools
        if self.renders_hermes(schemas):
            return self.tokenizer.apply_chat_template(hermes_messages(messages, schemas), tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        return self.tokenizer.apply_chat_template(messages, tools=schemas or None, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def check(self):
        """
        Refuse, before any model is built, a tokenizer or chat template that a rollout would fail on
        (ConfigError, with what to do): no chat template or EOS token, an end-of-call tag the tokenizer
        cannot write, a template that leaves the tools out, or that does not render a tool call, a tool
        result, an observation after EOS the way the trajectory's tokens need (observation_ids).
        """
        tok = self.tokenizer
        if not tok.chat_template:
            raise ConfigError("the model's tokenizer has no chat template; nanoagent renders prompts, tool "
                              "calls and observations with it: use a chat (instruct) model, or set "
                              "tokenizer.chat_template")
        if tok.eos_token_id is None:
            raise ConfigError("the model's tokenizer has no EOS token: "
                              "a turn that calls no tool could never end")
        written = tok.decode(tok.encode(CALL_END, add_special_tokens=False))
        if written != CALL_END:
            raise ConfigError(f"the model's tokenizer cannot write {CALL_END!r} (it decodes to {written!r}): "
                              "tool calls could not end")
        messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
        # the model's text as it comes: around it, whitespace that a template which trims content would lose
        call = f' <tool_call>\n{{"name": "probe", "arguments": {{}}}}\n{CALL_END}\n'
        try:
            if self.schemas:
                names = [s["function"]["name"] for s in self.schemas]
                if not all(name in self.render(messages) for name in names):
                    raise ValueError("the rendered prompt does not show the tools' names")
                self.observation_ids(messages, call, [{"role": "tool", "content": "R"}])
                self.truncate("R", "tool")
            self.observation_ids(messages, "\nA ", [{"role": "user", "content": "O"}], ended_with_eos=True)
            self.prompt_ids(messages)
        except Exception as e:
            raise ConfigError(f"the model's chat template cannot render a trajectory token-exactly ({e}); "
                              "rollout.tool_format=hermes renders tools with plain system/user/assistant "
                              "turns, or use a model whose template renders message content verbatim") from e

    def prompt_ids(self, messages, tools=None):
        """The ids of a conversation and the next assistant header, environment text as text."""
        text = self.render(marked(messages), add_generation_prompt=True, tools=tools)
        return self.encode_rendered(text, [m["content"] for m in messages if m["role"] not in TEXT_ROLES])

    def prompt_lengths(self, conversations):
        """len(prompt_ids(m)) for many conversations, with one batched encode (a prompt file at once)
        of those without a special token's string in their text, which encode_rendered would
        encode the same."""
        texts = [self.render(m, add_generation_prompt=True) for m in conversations]
        lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        return [len(self.prompt_ids(m))
                if any(x["role"] not in TEXT_ROLES and self._special_tokens.search(x["content"]) for x in m)
                else n for m, n in zip(conversations, lengths)]

    def observation_ids(self, messages, content, observation, ended_with_eos=False, tools=None):
        """
        The ids appended after an assistant turn whose text is `content` (the decoded action, stop
        tag included, EOS excluded): the template's closing glue of that turn, the observation
        messages, and the next assistant header. `messages` is the conversation before the
        assistant turn. When the model sampled EOS itself, that token is already the start of the
        closing glue. The observation's content is encoded as text (encode_rendered).
        """
        messages = marked(messages)
        before = self.render(messages, add_generation_prompt=True, tools=tools)
        with_turn = self.render(messages + [{"role": "assistant", "content": content}], tools=tools)
        if not with_turn.startswith(before + content):
            raise ValueError("the chat template does not render assistant content verbatim after the "
                             "generation prompt; token-in/token-out trajectories need a template that does")
        after = self.render(messages + [{"role": "assistant", "content": content}] + marked(observation),
                            add_generation_prompt=True, tools=tools)
        if not after.startswith(with_turn):
            raise ValueError("the chat template re-renders earlier turns when observation messages are added")
        text = with_turn[len(before + content):] + after[len(with_turn):]
        if ended_with_eos:
            if not text.startswith(self.tokenizer.eos_token):
                raise ValueError("the chat template does not close an assistant turn with the EOS token")
            text = text[len(self.tokenizer.eos_token):]
        return self.encode_rendered(text, [m["content"] for m in observation])

    def step_messages(self, messages, n_prompt):
        """
        What the next turn sees of a conversation under context=last_k: its first n_prompt messages
        (the system prompt and the task) and its last keep_turns turns, a turn being an assistant
        message with the observation that answered it. Older turns are left out whole.
        """
        starts = [i for i in range(n_prompt, len(messages)) if messages[i]["role"] == "assistant"]
        first = starts[-self.keep_turns] if len(starts) > self.keep_turns else n_prompt
        return messages[:n_prompt] + messages[first:]

    def step_prompt_ids(self, messages, n_prompt):
        """The prompt ids of the next turn under context=last_k, rendered afresh (step_messages)."""
        return self.prompt_ids(self.step_messages(messages, n_prompt))


def settle(future, outcome):
    """Give a step's Future its outcome (an exception: raised by result()), unless it has one already:
    the step's thread and expire() may race."""
    try:
        future.set_exception(outcome) if isinstance(outcome, BaseException) else future.set_result(outcome)
    except InvalidStateError:
        pass


class StepError(RuntimeError):
    """An environment's step failed: its trajectory ends ("env_error") with this as the reason."""


def is_messages(obj):
    return isinstance(obj, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                         and isinstance(m.get("content"), str) for m in obj)


def checked_context(obj, what):
    """A whole context as an environment gives it (a dict: messages, optional tools and max_tokens) -> a
    Context; anything else raises, saying what is wrong."""
    unknown = set(obj) - {"messages", "tools", "max_tokens"}
    messages, tools, max_tokens = obj.get("messages"), obj.get("tools"), obj.get("max_tokens")
    if unknown:
        raise TypeError(f"{what}'s context has unknown keys {sorted(unknown)} (messages, tools, max_tokens)")
    if not is_messages(messages) or not messages:
        raise TypeError(f"{what}'s context needs messages: a non-empty list of "
                        "{'role': str, 'content': str}")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise TypeError(f"{what}'s context tools are not a list of tool schemas")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or max_tokens < 1):
        raise ValueError(f"{what}'s context max_tokens {max_tokens!r} is not a positive integer")
    return Context(list(messages), None if tools is None else list(tools), max_tokens)


def checked_step(result):
    """A step's (observation, reward, done, info) as the loop takes it: the observation as a list of
    messages (a string is one user message) or a Context (a dict: the whole next context), the reward
    and the last step's outcome and step rewards finite floats. Anything else raises."""
    if not isinstance(result, tuple) or len(result) != 4:
        raise TypeError(f"step returned {type(result).__name__}, not (observation, reward, done, info)")
    observation, reward, done, info = result
    if isinstance(observation, str):
        observation = [{"role": "user", "content": observation}]
    elif isinstance(observation, dict):
        observation = checked_context(observation, "step")
    elif isinstance(observation, Context):  # made and checked by nanoagent (a flow's call)
        pass
    elif not is_messages(observation):
        raise TypeError("step's observation is neither a string, a list of {'role': str, 'content': str} "
                        "messages nor a context {'messages': [...]}")
    if not finite(reward):
        raise ValueError(f"step's reward {reward!r} is not a finite number")
    if not isinstance(info, dict):
        raise TypeError(f"step's info is a {type(info).__name__}, not a dict")
    if "outcome" in info and not finite(info["outcome"]):
        raise ValueError(f"step's outcome {info['outcome']!r} is not a finite number")
    if "step_rewards" in info and not (isinstance(info["step_rewards"], (list, tuple))
                                       and all(map(finite, info["step_rewards"]))):
        raise ValueError("step's step_rewards are not a list of finite numbers")
    return observation, float(reward), bool(done), info


def finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def marked(messages):
    """The conversation with TEXT_MARKER in place of each environment text (see encode_rendered)."""
    return [m if m["role"] in TEXT_ROLES else {**m, "content": TEXT_MARKER} for m in messages]


def template_shows_tools(tokenizer):
    """Whether the chat template renders a tools= list (one without tool support ignores it)."""
    probe = {"type": "function", "function": {"name": "nanoagent_probe_tool", "description": "",
                                              "parameters": {"type": "object", "properties": {}}}}
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tools=[probe],
                                             tokenize=False)
    return "nanoagent_probe_tool" in rendered


def tool_env(tools, tokenizer, max_obs_tokens=512, timeout_s=10.0, context="full", keep_turns=2, workers=4,
             max_abandoned=8, step_timeout_s=120.0, tool_format="auto", summary_tokens=0):
    """The ChatEnv of a tool task: a ToolCalling environment per trajectory over one ToolRunner,
    which runs the calls of every trajectory (batched where they wait together) under time limits."""
    runner = ToolRunner(tools, timeout_s, workers, max_abandoned)
    return ChatEnv(lambda: ToolCalling(runner), tokenizer, runner.schemas(), max_obs_tokens, context,
                   keep_turns, step_timeout_s, tool_format, summary_tokens)
