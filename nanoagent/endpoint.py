"""
An OpenAI-compatible endpoint over the training engine, for agents written with any framework (the
openai package, LangGraph, smolagents, ...): a task's agent(base_url, row) is trained unchanged.

Each trajectory's agent gets a base URL of its own, http://127.0.0.1:PORT/t/KEY/v1, where it calls

    POST /chat/completions   messages, tools, tool_choice ("auto" or "none"), max_tokens (at most
                             rollout.max_new_tokens), temperature and top_p (the run's, or left out:
                             the trainer's logprobs are of the distribution the run samples from), n=1
    GET  /models             the one model: the run's `model`, by that name

as on any OpenAI-compatible server. The endpoint (Starlette, served by uvicorn on loopback in a thread
of its own, for as long as the run) turns each request into a model call of the trajectory's flow
(flow.FlowEnv), which the rollout samples like any turn: the response is the turn, its tool calls
parsed as nanoagent parses them (<tool_call>{json}</tool_call>), finish_reason "tool_calls", "stop"
or "length", and usage.

Token exactness: an agent resends the history with each request, the endpoint's replies in it as the
agent kept them (the content and tool calls it was given, maybe rebuilt by a framework). An assistant
message that matches one the endpoint sent (its content and its calls' names and arguments) stands
for the text that was sampled, so the rollout finds the call it goes on from and keeps those ids
(agent.context_prompt_ids): the history is not re-tokenised. An assistant message that matches none
(the agent wrote or changed it) is rendered as text, and the call is a row of its own.

A request that cannot be served gets OpenAI's error shape, {"error": {"message", "type", "param",
"code"}}, at once: 400 for a bad body or parameter, 404 for an unknown model or trajectory, 413 when
the call's prompt is over rollout.max_context_tokens (the trajectory ends: context_budget), 400 when
its trajectory has ended otherwise (rollout.max_turns calls, an error).
"""

import asyncio
import json
import math
import socket
import threading
import time
import uuid

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.routing import Route

from nanoagent.env import Context
from nanoagent.flow import FlowEnv, FlowStopped
from nanoagent.tools import CALL_END, TOOL_CALL_RE

# accepted and left unused: they do not change what is sampled or how it is scored
IGNORED = {"user", "metadata", "store", "parallel_tool_calls", "seed", "stream_options", "service_tier"}


class RequestError(Exception):
    def __init__(self, status, message, param=None, code=None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_response(status, message, param=None, code=None):
    kind = {404: "not_found_error", 413: "invalid_request_error"}.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


class Trajectory:
    """What the endpoint keeps of one trajectory's agent: its flow and the assistant messages sent to it."""

    def __init__(self, flow):
        self.flow = flow
        self.sent = []  # (the message as sent, normalised: normal_assistant; the text that was sampled)


class Endpoint:
    """
    The endpoint of a run's agents (module docstring). model_name: the run's `model`, the one model it
    serves; temperature, top_p, max_new_tokens: the run's sampling (rollout.*), which requests may not
    change. agent_env(agent, first_call_s) makes the FlowEnv of one trajectory of a task's agent.
    """

    def __init__(self, model_name, temperature, top_p, max_new_tokens):
        self.model_name, self.temperature, self.top_p = model_name, temperature, top_p
        self.max_new_tokens = max_new_tokens
        self.trajectories = {}  # key -> Trajectory, while its agent runs
        self.lock = threading.Lock()
        routes = [Route("/t/{key}/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/t/{key}/v1/models", self.models, methods=["GET"])]
        app = Starlette(routes=routes, exception_handlers={
            HTTPException: lambda request, e: error_response(e.status_code, e.detail)})
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        # uvicorn installs no signal handlers outside the main thread: SIGTERM and Ctrl-C stay the trainer's
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                       name="nanoagent-endpoint")
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the agents' endpoint did not start (uvicorn's log says why)")
            time.sleep(0.005)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def agent_env(self, agent, first_call_s):
        """A function that makes the FlowEnv of one trajectory of agent(base_url, row) (ChatEnv's make)."""
        def run(flow, row):
            key = uuid.uuid4().hex
            with self.lock:
                self.trajectories[key] = Trajectory(flow)
            try:  # an async agent runs in an event loop of its own, in its thread
                result = agent(f"{self.url}/t/{key}/v1", row)
                return asyncio.run(result) if asyncio.iscoroutine(result) else result
            finally:
                with self.lock:
                    del self.trajectories[key]
        return lambda: FlowEnv(run, first_call_s)

    # -------------------------------------------------------------------------
    # the routes

    def trajectory(self, request):
        with self.lock:
            found = self.trajectories.get(request.path_params["key"])
        if found is None:
            raise RequestError(404, "unknown trajectory: each trajectory's agent has a base URL of its own, "
                                    "valid while the agent runs", code="trajectory_not_found")
        return found

    async def models(self, request):
        try:
            self.trajectory(request)
        except RequestError as e:
            return error_response(e.status, str(e), e.param, e.code)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "nanoagent"}
        return JSONResponse({"object": "list", "data": [model]})

    async def chat_completions(self, request):
        try:
            trajectory = self.trajectory(request)
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError) as e:
                raise RequestError(400, f"the request body is not JSON ({e})") from None
            context, tool_choice = self.context(body, trajectory)
            try:
                reply = await asyncio.wrap_future(trajectory.flow.call(context))
            except FlowStopped as e:
                if e.reason == "context_budget":
                    raise RequestError(413, "the prompt is over the context budget "
                                            "(rollout.max_context_tokens): the trajectory has ended",
                                       "messages", "context_length_exceeded")
                raise RequestError(400, str(e), code="trajectory_ended") from None
        except RequestError as e:
            return error_response(e.status, str(e), e.param, e.code)
        message, finish_reason = self.assistant_message(reply.text, reply.finish_reason, tool_choice,
                                                        trajectory)
        trajectory.sent.append((normal_assistant(message), reply.text))
        return JSONResponse({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
                      "total_tokens": reply.prompt_tokens + reply.completion_tokens}})

    # -------------------------------------------------------------------------
    # requests in, responses out

    def context(self, body, trajectory):
        """(the Context of a request's model call, its tool_choice); RequestError where it cannot be
        served."""
        if not isinstance(body, dict):
            raise RequestError(400, "the request body is not a JSON object")
        unknown = set(body) - IGNORED - {"model", "messages", "tools", "tool_choice", "temperature", "top_p",
                                         "n", "max_tokens", "max_completion_tokens", "stream", "stop"}
        if unknown:
            raise RequestError(400, f"unsupported parameter {sorted(unknown)[0]!r}", sorted(unknown)[0])
        if not isinstance(body.get("model"), str):
            raise RequestError(400, "model is required: a string", "model")
        if body["model"] != self.model_name:
            raise RequestError(404, f"the model {body['model']!r} does not exist: this endpoint serves "
                                    f"{self.model_name!r} (GET /models)", "model", "model_not_found")
        for key, run in (("temperature", self.temperature), ("top_p", self.top_p)):
            value = body.get(key)
            if value is not None and (not isinstance(value, (int, float)) or not math.isclose(value, run)):
                raise RequestError(400, f"{key}={value!r}: the run samples at {key} {run:g} (rollout.{key}), "
                                        "which the trainer's logprobs assume; leave it out or send that", key)
        if body.get("n") not in (None, 1):
            raise RequestError(400, "n must be 1: a trajectory samples one reply per call (a group is "
                                    "rollout.group_size trajectories)", "n")
        if body.get("stream"):
            raise RequestError(400, "stream=true is not supported", "stream")
        if body.get("stop"):
            raise RequestError(400, "stop sequences are not supported: a turn stops at EOS or at the end "
                                    "of a tool call", "stop")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or not 1 <= max_tokens <= self.max_new_tokens):
            raise RequestError(400, f"{param}={max_tokens!r}: must be an integer from 1 to "
                                    f"{self.max_new_tokens} (rollout.max_new_tokens)", param)
        tool_choice = body.get("tool_choice") or "auto"
        if tool_choice not in ("auto", "none"):
            raise RequestError(400, "tool_choice must be 'auto' or 'none': the policy samples freely, and RL "
                                    "trains what it chose", "tool_choice")
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(
                isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) for t in tools)):
            raise RequestError(400, "tools must be a list of {'type': 'function', 'function': {'name': ..., "
                                    "'description': ..., 'parameters': {...}}}", "tools")
        keys = ("name", "description", "parameters")
        schemas = [] if tool_choice == "none" or not tools else [
            {"type": "function", "function": {k: t["function"][k] for k in keys if k in t["function"]}}
            for t in tools]
        return Context(self.messages(body.get("messages"), trajectory), schemas, max_tokens), tool_choice

    def messages(self, messages, trajectory):
        """An OpenAI chat history -> nanoagent's messages ({role, content}, a turn's tool calls in its text as
        the model writes them); the assistant messages the endpoint sent, as the text that was sampled."""
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError(400, "messages must be a non-empty list of message objects", "messages")
        out, calls_open = [], False  # calls_open: the last message made tool calls, or answered them
        for i, m in enumerate(messages):
            role, param = m.get("role"), f"messages[{i}]"
            if role in ("system", "developer", "user"):
                out.append({"role": "system" if role == "developer" else role, "content": text_of(m, param)})
                calls_open = False
            elif role == "assistant":
                sent = normal_assistant(m, param)
                text = next((text for message, text in reversed(trajectory.sent) if message == sent), None)
                out.append({"role": "assistant", "content": text if text is not None else written_text(sent)})
                calls_open = bool(sent[1])
            elif role == "tool":
                if not calls_open:
                    raise RequestError(400, f"{param}: a message with role 'tool' must answer an assistant "
                                            "message's tool_calls", param)
                out.append({"role": "tool", "content": text_of(m, param)})
            else:
                raise RequestError(400, f"{param}.role {role!r} is not system, developer, user, assistant or "
                                        "tool", f"{param}.role")
        if out[-1]["role"] == "assistant":
            raise RequestError(400, "the last message is the assistant's: a call samples the next assistant "
                                    "turn", "messages")
        return out

    def assistant_message(self, text, finish_reason, tool_choice, trajectory):
        """(the response's message, its finish_reason) of a sampled turn: well-formed tool calls as tool_calls
        (tool_choice auto), the text around them as content; anything else the text as content."""
        calls = TOOL_CALL_RE.findall(text)
        parsed = [parse_call(body) for body in calls]
        if tool_choice == "none" or not calls or None in parsed or text.count("<tool_call>") > len(calls):
            return {"role": "assistant", "content": text}, "length" if finish_reason == "length" else "stop"
        n = len(trajectory.sent)
        tool_calls = [{"id": f"call_{n}_{i}", "type": "function",
                       "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
                      for i, (name, arguments) in enumerate(parsed)]
        content = TOOL_CALL_RE.sub("", text).strip() or None
        return {"role": "assistant", "content": content, "tool_calls": tool_calls}, "tool_calls"


def parse_call(body):
    """(name, arguments) of a <tool_call> body, or None where it is not a call (parse_tool_calls' rule)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    arguments = obj.get("arguments") if isinstance(obj, dict) else None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(arguments, dict):
        return None
    return obj["name"], arguments


def text_of(message, param):
    """A message's content as text: a string, or a list of text parts."""
    content = message.get("content")
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(400, f"{param}.content must be a string or a list of text parts", f"{param}.content")


def normal_assistant(message, param="message"):
    """An assistant message as (content, ((name, arguments), ...)), the form in which an agent's copy of a
    reply is compared with what was sent: a framework may rebuild the message, drop an empty content or
    re-serialise the arguments."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise RequestError(400, f"{param}.tool_calls must be a list", f"{param}.tool_calls")
    normal = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(400, f"{param}.tool_calls[{k}] must be {{'type': 'function', 'function': "
                                    "{'name', 'arguments'}}", f"{param}.tool_calls")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass
        normal.append((function["name"], json.dumps(arguments, sort_keys=True, ensure_ascii=False)))
    return text_of(message, param), tuple(normal)


def written_text(normal):
    """The text of an assistant message the endpoint did not send, as the model would have written it: its
    content, then each tool call in nanoagent's tags."""
    content, calls = normal
    written = [f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{CALL_END}'
               for name, arguments in calls]
    return "\n".join(([content] if content else []) + written)
