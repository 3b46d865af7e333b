"""
Agent flows (nanoagent/flow.py) and the OpenAI-compatible endpoint (nanoagent/endpoint.py) through the
real agent loop and vLLM engine, with the tiny model that memorised the scripted tool conversations
(tests/scripted.py): a tool loop written as a flow, or as an agent with the openai package over real
HTTP, trains exactly as the tool environment does; branches share their prompt; a rewritten history is
a row of its own; flows that fail end only their own trajectory; requests that cannot be served get
OpenAI's error statuses; a paused flow goes on under new weights token-exactly.
"""

import asyncio
import itertools
import json
import threading
import time

import httpx
import pytest
import torch
from openai import BadRequestError, OpenAI
from transformers import AutoModelForCausalLM

import scripted
from padded import load_policy
from test_rollout import GREEDY, MAX_CONTEXT, env, samples, scripted_dir, tools, trainer_logprobs  # noqa: F401
from nanoagent import rl
from nanoagent.agent import Rollouts, observe, run_agent, start_trajectories, take_turn
from nanoagent.batch import packed_tokens, step_batch
from nanoagent.config import make_config
from nanoagent.endpoint import Endpoint, normal_assistant
from nanoagent.engine import SamplingConfig, VLLMEngine, stop_token_ids
from nanoagent.env import Action, ChatEnv
from nanoagent.flow import FlowStopped, flow_env
from nanoagent.model import forward_all, policy_forward

pytestmark = pytest.mark.slow
SAMPLED = SamplingConfig(max_new_tokens=48, temperature=1.0)
MODEL = "scripted-tiny"


@pytest.fixture(scope="module")
def engine(scripted_dir, env):  # noqa: F811
    engine = VLLMEngine(scripted_dir, stop_token_ids(env.tokenizer), MAX_CONTEXT, dtype="float32", seed=0, compile=False)
    yield engine
    del engine
    from vllm.distributed import cleanup_dist_env_and_memory
    cleanup_dist_env_and_memory()


def flows(env, flow, step_timeout_s=30.0):  # noqa: F811
    """The ChatEnv of a task's flow, as tasks.task_env makes it: the tools come with each call."""
    return ChatEnv(flow_env(flow, step_timeout_s), env.tokenizer, (), env.max_obs_tokens, step_timeout_s=step_timeout_s)


def same_rows(a, b):
    """The same rows, spans and versions, token for token; the engine's logprobs to the engine's noise (they
    depend a little on what else it decoded in the same step)."""
    (rows_a, places_a), (rows_b, places_b) = a.assemble(), b.assemble()
    assert places_a == places_b and len(rows_a) == len(rows_b)
    for (ids, mask, logprobs, spans, versions), (ids_b, mask_b, logprobs_b, spans_b, versions_b) in zip(rows_a, rows_b):
        assert (ids, mask, spans, versions) == (ids_b, mask_b, spans_b, versions_b)
        assert max(abs(x - y) for x, y in zip(logprobs, logprobs_b)) <= 1e-5


def answered(text):
    return 1.0 if "<answer>" in text else 0.0


def tool_loop(env):  # noqa: F811
    """ToolCalling's loop as a flow of the agent's own: the same tools (one runner), the same cut of each result."""
    runner = env.make().runner

    def flow(client, row):
        messages = list(row["messages"])
        while True:
            reply = client.chat(messages, tools=env.schemas)
            messages.append(reply.message)
            calls = reply.tool_calls
            if not calls:
                return answered(reply.text)
            runner.start(calls).result()
            messages += [{"role": "tool", "content": env.truncate(c.result, "tool")} for c in calls]
    return flow


def test_a_tool_loop_written_as_a_flow_trains_exactly_as_the_tool_environment(engine, env, scripted_dir):  # noqa: F811
    """The same ids, masks and rows (one growing row: each call goes on from the last, its ids kept), hence the
    same batch and the same loss, sampled at temperature 1 with the same seeds, some
    trajectories running into rollout.max_turns."""
    G = 2
    rows = [s for s in samples() for _ in range(G)]
    reference = run_agent(engine, env, rows, SAMPLED, max_turns=3, max_context_tokens=MAX_CONTEXT, seed=5)
    for t in reference:  # what the flow returns; nothing where rollout.max_turns ended it
        t.reward = answered(t.final_text) if t.finish_reason == "done" else 0.0
    trajs = run_agent(engine, flows(env, tool_loop(env)), rows, SAMPLED, max_turns=3, max_context_tokens=MAX_CONTEXT,
                      seed=5)
    for t in trajs:
        t.reward = t.outcome if t.outcome is not None else 0.0
    for a, b in zip(trajs, reference):
        assert a.prompt_ids == b.prompt_ids and a.turn_ids(len(a.turn_spans) - 1) == b.turn_ids(len(b.turn_spans) - 1)
        same_rows(a, b)
        assert a.finish_reason == b.finish_reason and a.reward == b.reward and len(a.sequences()) == 1
    assert {t.finish_reason for t in reference} >= {"done", "max_turns"} and max(len(t.turn_spans) for t in trajs) == 3
    cfg = make_config("tiny", ["rollout.group_size=2", "grpo.drop_uniform_groups=false", "train.tool_call_reward=0"])
    pad = env.tokenizer.pad_token_id
    a, b = step_batch(trajs, pad, cfg), step_batch(reference, pad, cfg)
    for key in ["input_ids", "position_ids", "prompt", "action_mask", "version", "step"]:
        assert torch.equal(a.batch[key], b.batch[key]), key
    assert a.batch["steps"] == b.batch["steps"] and torch.equal(a.rewards, b.rewards)
    model = load_policy(scripted_dir)
    losses = []
    for data in (a, b):
        logprobs = forward_all(lambda *packed: policy_forward(model, *packed)[0], data.batch, data.kept, 4096, "cpu")
        advantages = rl.grpo_advantages(data.scores["outcome"], data.scores["group"])[data.batch["trajectory"]][:, None]
        loss, _ = rl.ppo_policy_loss(logprobs, logprobs.detach(), advantages.expand_as(logprobs),
                                     data.batch["action_mask"])
        losses.append(loss.sum() / data.batch["action_mask"].sum())
    assert losses[0].item() == losses[1].item() and losses[0].item() != 0


def test_a_call_that_goes_on_keeps_the_sampled_ids_not_a_re_tokenisation(env):  # noqa: F811
    """The ids an engine samples need not be the tokenizer's own encoding of their text ("answer" sampled letter by
    letter): a call whose messages go on from a reply keeps the reply's sampled ids, where rendering the
    conversation afresh would re-tokenise them into others."""
    tok, text = env.tokenizer, "<answer>Ada Quill</answer>"

    def flow(client, row):
        reply = client.chat(row["messages"])
        client.chat(row["messages"] + [reply.message, {"role": "user", "content": "Sure?"}])
        return 1.0

    flow_env = flows(env, flow)
    [t] = start_trajectories(flow_env, samples()[:1], MAX_CONTEXT)
    sampled = [i for ch in text for i in tok.encode(ch, add_special_tokens=False)] + [tok.eos_token_id]
    assert sampled[:-1] != tok.encode(text, add_special_tokens=False)  # not the canonical encoding
    content, eos = take_turn(t, sampled, [0.0] * len(sampled), tok)
    assert observe(t, flow_env, flow_env.start(t.env, Action(content)), content, eos, False, None, MAX_CONTEXT)
    assert t.step_prompts[1][:len(t.prompt_ids) + len(sampled)] == t.prompt_ids + sampled
    assert t.step_prompts[1] != flow_env.prompt_ids(t.contexts[1].messages)  # afresh: re-tokenised
    assert tok.decode(t.step_prompts[1]) == tok.decode(flow_env.prompt_ids(t.contexts[1].messages))
    [(ids, mask, *_)] = t.sequences()  # and the row the trainer scores holds them
    assert ids[len(t.prompt_ids):len(t.prompt_ids) + len(sampled)] == sampled


def test_the_endpoint_maps_an_agents_copy_of_a_reply_to_what_was_sampled(env, endpoint):  # noqa: F811
    """A reply with text around an oddly spaced tool call goes out as OpenAI's content and tool_calls; the agent's
    copy of it (content dropped or kept, arguments re-serialised, extra keys) comes back as the text that was
    sampled, whitespace included, so the rollout keeps its ids; a message the endpoint never sent is written in
    nanoagent's tags."""
    from nanoagent.endpoint import Trajectory as Kept
    text = 'Let me compute.\n<tool_call>\n{"name":"calculator",  "arguments":{"expression":"12*7"}}\n</tool_call>'
    kept = Kept(flow=None)
    message, finish_reason = endpoint.assistant_message(text, "stop", "auto", kept)
    assert finish_reason == "tool_calls" and message["content"] == "Let me compute."
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "12*7"}'}
    kept.sent.append((normal_assistant(message), text))
    copy = {"role": "assistant", "content": "Let me compute.", "refusal": None,
            "tool_calls": [{"id": call["id"], "type": "function",
                            "function": {"name": "calculator", "arguments": '{ "expression" : "12*7" }'}}]}
    history = [{"role": "user", "content": [{"type": "text", "text": "12*7?"}]}, copy,
               {"role": "tool", "tool_call_id": call["id"], "content": "84"}]
    assert endpoint.messages(history, kept) == [{"role": "user", "content": "12*7?"}, {"role": "assistant", "content": text},
                                                {"role": "tool", "content": "84"}]
    other = {**copy, "content": None, "tool_calls": [{**copy["tool_calls"][0], "function": {"name": "calculator",
                                                                                         "arguments": '{"expression": "1"}'}}]}
    [_, written, _] = endpoint.messages([history[0], other, history[2]], kept)
    assert written["content"] == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}\n</tool_call>'


def test_two_branches_from_one_prompt_share_it(engine, env):  # noqa: F811
    """An async flow samples two replies to one prompt at once (its calls wait their turn), then goes on from
    the first: three turns, two rows, the prompt shared (computed once in the update's packed passes)."""
    def flow(client, row):
        async def branches():
            messages = list(row["messages"])
            first, second = await asyncio.gather(client.achat(messages), client.achat(messages))
            await client.achat(messages + [first.message, {"role": "user", "content": "Go on."}])
            return 1.0
        return branches()

    trajs = run_agent(engine, flows(env, flow), samples()[:2], SAMPLED, max_turns=4, max_context_tokens=MAX_CONTEXT,
                      seed=1)
    cfg = make_config("tiny", ["rollout.group_size=1", "algo=reinforce", "ppo.mini_batch_size=8"])
    for t in trajs:
        rows, places = t.assemble()
        assert t.finish_reason == "done" and t.outcome == 1.0 and len(rows) == 2
        assert [row for row, _, _ in places] == [0, 1, 0]  # the third call went on from the first
        assert rows[0][0][:len(t.prompt_ids)] == rows[1][0][:len(t.prompt_ids)] == t.prompt_ids
        assert rows[1][0] == t.prompt_ids + t.turn_ids(1)[1]
        data = step_batch([t], env.tokenizer.pad_token_id, cfg)
        assert data.batch["prompt"].tolist() == [0, 0]
        assert packed_tokens(data.batch, [0, 1]) == len(rows[0][0]) + len(rows[1][0]) - len(t.prompt_ids)


def test_a_rewritten_history_is_a_row_of_its_own(engine, env):  # noqa: F811
    """A flow that replaces its history with a summary of its own: the second call's prompt is that history
    rendered afresh, in a row of its own (no shared ids assumed); a third call that goes on from it joins it."""
    def flow(client, row):
        first = client.chat(row["messages"])
        rewritten = [row["messages"][0], {"role": "user", "content": "Earlier you said: " + first.text[:20]}]
        second = client.chat(rewritten)
        client.chat(rewritten + [second.message, {"role": "user", "content": "And?"}])
        return 0.5

    flow_env = flows(env, flow)
    [t] = run_agent(engine, flow_env, samples()[:1], SAMPLED, max_turns=4, max_context_tokens=MAX_CONTEXT, seed=2)
    rows, places = t.assemble()
    assert t.finish_reason == "done" and len(rows) == 2 and [row for row, _, _ in places] == [0, 1, 1]
    rewritten = t.contexts[1].messages
    assert t.step_prompts[1] == flow_env.prompt_ids(rewritten)  # rendered afresh
    assert rows[1][0][:len(t.step_prompts[1])] == t.step_prompts[1] and rows[0][0][:len(t.prompt_ids)] == t.prompt_ids
    assert rows[1][0][:len(t.step_prompts[2])] == t.step_prompts[2]
    assert rows[0][0] != rows[1][0][:len(rows[0][0])]


def test_flows_that_fail_end_only_their_own_trajectory(engine, env):  # noqa: F811
    """Among flows that answer, flows that raise after a call, hang past rollout.step_timeout_s, return what is
    not a reward, raise before their first call or make one over the context budget: each ends its own
    trajectory (env_error, with the reason), whose calls then fail; the others end as they would alone, and
    they alone are trained on."""
    stopped = []

    def flow(client, row):
        how = row["how"]
        if how == "before":
            raise KeyError("no such row")
        if how == "long":
            client.chat([{"role": "user", "content": "word " * 3000}])
        reply = client.chat(row["messages"])
        if how == "raise":
            return 1 / 0
        if how == "hang":
            threading.Event().wait(6)
            try:
                client.chat(row["messages"])
            except FlowStopped as e:
                stopped.append(e.reason)
            return 1.0
        if how == "garbage":
            return "yes"
        return answered(reply.text)

    hows = ["fine", "raise", "hang", "garbage", "before", "long", "fine"]
    rows = [{**samples()[6], "id": how + str(i), "how": how} for i, how in enumerate(hows)]
    start = time.perf_counter()
    trajs = run_agent(engine, flows(env, flow, step_timeout_s=3.0), rows, SAMPLED, max_turns=3,
                      max_context_tokens=MAX_CONTEXT, seed=3)
    assert time.perf_counter() - start < 15  # the hung flow was abandoned at its time limit
    reasons = [t.finish_reason for t in trajs]
    assert reasons == ["done", "env_error", "env_error", "env_error", "env_error", "env_error", "done"]
    errors = [t.error for t in trajs]
    assert "ZeroDivisionError" in errors[1] and "test_flow.py:" in errors[1]
    assert "did not return within 3s" in errors[2]
    assert "not a reward" in errors[3]
    assert "did not reset" in errors[4] and "KeyError" in errors[4] and trajs[4].turn_spans == []
    assert "over the context budget" in errors[5] and trajs[5].turn_spans == []
    deadline = time.perf_counter() + 30
    while not stopped and time.perf_counter() < deadline:
        time.sleep(0.1)
    assert stopped == ["env_error"]  # the hung flow's next call failed: its trajectory had ended
    for t in trajs:
        t.reward = t.outcome or 0.0
    data = step_batch(trajs, env.tokenizer.pad_token_id, make_config("tiny", ["rollout.group_size=1", "algo=reinforce", "ppo.mini_batch_size=8"]))
    assert sorted({data.batch["trajectory"][r].item() for r in data.kept}) == [0, 6]
    assert data.dropped["dropped_env_error"] == 5


def test_a_paused_flow_goes_on_under_new_weights_token_exactly(engine, env, tiny_model_dir, scripted_dir):  # noqa: F811
    """Partial rollouts with flows: pause() aborts the calls in the engine mid-way, the flows wait, and the next
    run goes on under new weights; each call's row is what the two versions sampled, the rows are the tool
    environment's under the same schedule, and every logprob is that of the weights that sampled it."""
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    memorised = AutoModelForCausalLM.from_pretrained(scripted_dir, dtype=torch.float32)
    results = []
    for environment in (flows(env, tool_loop(env)), env):
        rollouts = Rollouts(engine, environment, SamplingConfig(max_new_tokens=48, temperature=1.0), max_turns=3,
                            max_context_tokens=MAX_CONTEXT)
        trajs = rollouts.start(samples()[:4], seed=3)
        engine_steps = itertools.count(1)
        rollouts.run(lambda: next(engine_steps) == 4)  # a few tokens into every first call
        rollouts.pause()
        assert all(t.partial[0] for t in trajs) and not any(t.finish_reason for t in trajs)
        try:
            engine.load_weights(base.state_dict().items())
            rollouts.version = 1
            rollouts.run()
        finally:
            engine.load_weights(memorised.state_dict().items())
        results.append(trajs)
    for t, reference in zip(*results):
        assert t.finish_reason == reference.finish_reason
        same_rows(t, reference)
        [(ids, mask, logprobs, _, versions)] = t.sequences()
        full = type(t)(sample=t.sample, prompt_ids=t.prompt_ids, messages=[], response_ids=ids[len(t.prompt_ids):])
        mask, versions = torch.tensor(mask[len(t.prompt_ids):], dtype=torch.bool), torch.tensor(versions[len(t.prompt_ids):])
        assert versions[mask][0] == 0 and versions[mask][-1] == 1
        expected = torch.where(versions == 0, trainer_logprobs(memorised, full, 1.0), trainer_logprobs(base, full, 1.0))
        assert (torch.tensor(logprobs[len(t.prompt_ids):]) - expected)[mask].abs().max() <= 1e-4


# -----------------------------------------------------------------------------
# the endpoint

def openai_agent(env):  # noqa: F811
    """A tool-calling agent written with the openai package, as one would for any OpenAI-compatible server: it
    keeps the replies as the SDK gives them (model_dump) and answers the tool calls by their ids."""
    runner = env.make().runner

    def agent(base_url, row):
        from nanoagent.tools import ToolCall
        client = OpenAI(base_url=base_url, api_key="none", max_retries=0)
        messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
        while True:
            try:
                response = client.chat.completions.create(model=MODEL, messages=messages, tools=env.schemas)
            except BadRequestError as e:  # the trajectory has ended (rollout.max_turns)
                assert e.body["code"] == "trajectory_ended", e
                return 0.0
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return answered(message.content or "")
            calls = [ToolCall(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
            runner.start(calls).result()
            messages += [{"role": "tool", "tool_call_id": c.id, "content": env.truncate(call.result, "tool")}
                         for c, call in zip(message.tool_calls, calls)]
    return agent


@pytest.fixture(scope="module")
def endpoint(env):  # noqa: F811
    endpoint = Endpoint(MODEL, 1.0, 1.0, 48)
    yield endpoint
    endpoint.stop()


def agents(env, endpoint, agent, step_timeout_s=30.0):  # noqa: F811
    return ChatEnv(endpoint.agent_env(agent, step_timeout_s), env.tokenizer, (), env.max_obs_tokens,
                   step_timeout_s=step_timeout_s)


def wait_for_agents(endpoint):
    """Until every agent has returned: one whose trajectory has ended goes on until its next call fails."""
    deadline = time.perf_counter() + 10
    while endpoint.trajectories and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert not endpoint.trajectories


def test_an_openai_agent_over_http_trains_exactly_as_the_tool_environment(engine, env, endpoint):  # noqa: F811
    """32 trajectories at once, each agent with its own base URL, over real HTTP on loopback: the agent resends
    the SDK's copies of the replies (content None, tool calls re-serialised), the endpoint matches them to
    what was sampled, and every trajectory is the tool environment's token for token (one row: no history
    re-tokenised), each call's prompt what the template renders of the agent's messages."""
    rows = [s for s in samples() for _ in range(4)]
    reference = run_agent(engine, env, rows, SAMPLED, max_turns=3, max_context_tokens=MAX_CONTEXT, seed=7)
    trajs = run_agent(engine, agents(env, endpoint, openai_agent(env)), rows, SAMPLED, max_turns=3,
                      max_context_tokens=MAX_CONTEXT, seed=7)
    wait_for_agents(endpoint)
    tok = env.tokenizer
    for t, r in zip(trajs, reference):
        if any(c.name is None for c in r.tool_calls):  # a call that did not parse: the agent reads text, and answers
            assert t.finish_reason in ("done", "truncated") and len(t.turn_spans) == 1 and t.turn_ids(0) == r.turn_ids(0)
            continue
        same_rows(t, r)
        assert t.finish_reason == r.finish_reason, t.sample["id"]
        for k, context in enumerate(t.contexts[:len(t.turn_spans)]):
            prompt, _ = t.turn_ids(k)
            assert tok.decode(prompt, skip_special_tokens=False) == env.render(context.messages, add_generation_prompt=True)
    assert sum(len(t.turn_spans) > 1 for t in trajs) >= 16 and any(t.finish_reason == "max_turns" for t in trajs)


def test_requests_that_cannot_be_served_get_openai_errors(engine, env, endpoint):  # noqa: F811
    """Malformed requests are answered at once with OpenAI's error shape and status; the trajectory's good call
    then goes through; an unknown trajectory is 404, and a call over the context budget 413."""
    seen = {}

    def agent(base_url, row):
        url = base_url + "/chat/completions"
        good = {"model": MODEL, "messages": row["messages"]}
        bad = {
            "bad json": b"{not json",
            "unknown model": {**good, "model": "gpt-4o"},
            "tools not a list": {**good, "tools": {"type": "function"}},
            "tool before a call": {**good, "messages": [row["messages"][0], {"role": "tool", "content": "3"}]},
            "ends with the assistant": {**good, "messages": row["messages"] + [{"role": "assistant", "content": "x"}]},
            "other temperature": {**good, "temperature": 0.2},
            "too many tokens": {**good, "max_tokens": 4096},
            "n": {**good, "n": 2},
            "stream": {**good, "stream": True},
            "unknown role": {**good, "messages": [{"role": "robot", "content": "hi"}]},
        }
        with httpx.Client(timeout=30) as http:
            for name, body in bad.items():
                response = http.post(url, content=body) if isinstance(body, bytes) else http.post(url, json=body)
                seen[name] = (response.status_code, response.json()["error"])
            seen["unknown trajectory"] = (http.post(url.replace("/t/", "/t/nobody-"), json=good).status_code, None)
            seen["models"] = (http.get(base_url + "/models").json()["data"][0]["id"], None)
            ok = http.post(url, json={**good, "temperature": 1.0, "max_tokens": 8})
            seen["good"] = (ok.status_code, ok.json()["choices"][0]["finish_reason"])
            long = [{"role": "user", "content": "word " * 3000}]
            seen["over budget"] = (http.post(url, json={**good, "messages": long}).status_code, None)
            seen["after the end"] = (http.post(url, json=good).status_code, None)
        return 0.0

    [t] = run_agent(engine, agents(env, endpoint, agent), samples()[6:7], SAMPLED, max_turns=3,
                    max_context_tokens=MAX_CONTEXT, seed=1)
    wait_for_agents(endpoint)
    statuses = {name: status for name, (status, _) in seen.items()}
    assert statuses == {"bad json": 400, "unknown model": 404, "tools not a list": 400, "tool before a call": 400,
                        "ends with the assistant": 400, "other temperature": 400, "too many tokens": 400, "n": 400,
                        "stream": 400, "unknown role": 400, "unknown trajectory": 404, "models": MODEL,
                        "good": 200, "over budget": 413, "after the end": 413}, seen
    assert seen["good"][1] in ("stop", "length")
    assert seen["unknown model"][1]["code"] == "model_not_found" and seen["tools not a list"][1]["param"] == "tools"
    assert all(set(error) == {"message", "type", "param", "code"} for status, error in seen.values()
               if isinstance(error, dict))
    assert t.finish_reason == "context_budget" and len(t.turn_spans) == 1
