"""
The multi-turn rollout with the real vLLM CPU engine and a tiny model that has memorised scripted
tool-using conversations (tests/scripted.py), so every path runs through real sampling and tools.
"""

import itertools
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import procs
import report
import scripted
from padded import load_policy
from nanoagent.agent import Rollouts, run_agent
from nanoagent.batch import collate
from nanoagent.engine import HFEngine, SamplingConfig, VLLMEngine, stop_token_ids
from nanoagent.model import forward_all, policy_forward
from nanoagent.retriever import InMemoryRetriever, load_encoder, packaged_minilm_path
from nanoagent.reward import score_trajectory
from nanoagent.env import TEXT_MARKER, ChatEnv, tool_env
from nanoagent.tools import Tool, calculator_tool, make_tools, search_tool

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_CONTEXT = 2048
GREEDY = SamplingConfig(max_new_tokens=48, greedy=True)
TIMEOUT_S = 5  # a limit far beyond what calculator and search need (ms), even on a busy machine; the 30 s sleep always outlasts it


@pytest.fixture(scope="module")
def tools():
    """The scripts' tools, by name."""
    slow = Tool("sleep", "Sleep for a while.", {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]},
                lambda a: (time.sleep(a["seconds"]), "done")[1])
    retriever = InMemoryRetriever(scripted.CORPUS, load_encoder(packaged_minilm_path(), device="cpu"))
    return {t.name: t for t in [calculator_tool(), slow, search_tool(retriever, top_k=1)]}


@pytest.fixture(scope="module")
def env(tiny_model_dir, tools):
    return tool_env(list(tools.values()), AutoTokenizer.from_pretrained(tiny_model_dir), max_obs_tokens=64, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def scripted_dir(tiny_model_dir, env, build_once):
    """The tiny model after memorising the scripts (test_flow.py's too): made once for the whole suite."""
    def memorise(path):
        _, loss = scripted.memorise(tiny_model_dir, path, env, steps=150)
        assert loss < 0.05, f"the tiny model did not memorise the scripts (loss {loss:.3f})"
    return build_once("scripted", memorise)


@pytest.fixture(scope="module")
def engine(scripted_dir, env):
    """The real vLLM CPU engine, in process; the torch.distributed world of one it sets up for itself
    goes with it (make test's workers run other modules' tests in this process after these). Eager, to
    start faster (the compiled path: test_engine.py)."""
    engine = VLLMEngine(scripted_dir, stop_token_ids(env.tokenizer), MAX_CONTEXT, dtype="float32", seed=0, compile=False)
    yield engine
    del engine
    from vllm.distributed import cleanup_dist_env_and_memory  # here: the GPU machine collects this module without vLLM
    cleanup_dist_env_and_memory()


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    """scripted.CORPUS as an on-disk index, built by build_index.py with the packaged MiniLM."""
    sys.path.insert(0, ROOT)
    import build_index
    root = tmp_path_factory.mktemp("index")
    (root / "corpus.jsonl").write_text("".join(json.dumps(p) + "\n" for p in scripted.CORPUS))
    build_index.main([f"--corpus={root / 'corpus.jsonl'}", f"--out={root / 'index'}", f"--encoder={packaged_minilm_path()}"])
    return str(root / "index")


def samples():
    return [{"id": q, "messages": scripted.user(q), "answers": []} for q in scripted.SCRIPTS]


@pytest.fixture(scope="module")
def greedy_trajs(engine, env):
    return {t.sample["id"]: t for t in run_agent(engine, env, samples(), GREEDY, max_turns=4, max_context_tokens=MAX_CONTEXT)}


def test_tool_errors_and_finish_reasons(greedy_trajs, engine, env):
    t = greedy_trajs
    assert [(c.name, c.result) for c in t["Compute 12*7."].tool_calls] == [("calculator", "84")]
    assert t["Compute 12*7."].final_text == "<answer>84</answer>" and t["Compute 12*7."].finish_reason == "done"
    assert "invalid JSON" in t["Send broken json."].tool_calls[0].result
    assert "unknown tool 'weather'" in t["Ask the weather."].tool_calls[0].result
    assert "bad arguments for calculator" in t["Use wrong arguments."].tool_calls[0].result
    assert "timed out" in t["Wait a long time."].tool_calls[0].result
    assert t["Who founded Nanotown?"].tool_calls[0].result.startswith("Doc 1 (Title: Nanotown)")
    for q in ["Send broken json.", "Ask the weather.", "Use wrong arguments.", "Wait a long time.", "Who founded Nanotown?"]:
        assert t[q].finish_reason == "done" and len(t[q].turn_spans) == 2, q  # the model read the error and went on
    assert t["Keep calculating."].finish_reason == "max_turns" and len(t["Keep calculating."].turn_spans) == 4
    # the last allowed turn's call runs too (its environment steps), but the model never reads its result
    assert [c.result for c in t["Keep calculating."].tool_calls] == ["2"] * 4 and t["Keep calculating."].messages[-1]["role"] == "assistant"
    assert t["Say hi."].finish_reason == "done" and t["Say hi."].tool_calls == []
    # the context budget ends a trajectory whose next observation would not fit
    [short] = run_agent(engine, env, [samples()[5]], GREEDY, max_turns=6, max_context_tokens=len(t["Keep calculating."].prompt_ids) + 100)
    assert short.finish_reason == "context_budget" and len(short) < len(short.prompt_ids) + 100
    # a turn cut by max_new_tokens without a tool call
    [cut] = run_agent(engine, env, [samples()[6]], SamplingConfig(max_new_tokens=3, greedy=True), max_turns=4, max_context_tokens=MAX_CONTEXT)
    assert cut.finish_reason == "truncated" and len(cut.response_ids) == 3
    # a last turn cut inside its tool call was cut too: by max_new_tokens, or by the context budget
    [opened] = run_agent(engine, env, [samples()[0]], SamplingConfig(max_new_tokens=3, greedy=True), max_turns=1, max_context_tokens=MAX_CONTEXT)
    assert env.tokenizer.decode(opened.response_ids).startswith("<tool_call>") and "was not closed" in opened.tool_calls[0].result
    assert opened.finish_reason == "truncated"
    [squeezed] = run_agent(engine, env, [samples()[0]], GREEDY, max_turns=1, max_context_tokens=len(opened.prompt_ids) + 3)
    assert squeezed.response_ids == opened.response_ids and squeezed.finish_reason == "context_budget"


def check_token_exact(traj, env):
    tok = env.tokenizer
    n = len(traj.response_ids)
    assert len(traj.action_mask) == len(traj.rollout_logprobs) == n
    in_spans = [0] * n
    for s, e in traj.turn_spans:
        in_spans[s:e] = [1] * (e - s)
    assert in_spans == traj.action_mask  # mask 1 exactly on the turns the engine generated
    assert traj.prompt_ids == tok.encode(env.render(traj.sample["messages"], add_generation_prompt=True), add_special_tokens=False)
    # every environment segment is the canonical tokenization of its template text, the tool results as
    # text: a result may quote a special token's string (an error message quoting a sampled argument)
    segments, start = [], None
    for i, m in enumerate(traj.action_mask + [1]):
        if m == 0 and start is None:
            start = i
        elif m == 1 and start is not None:
            segments.append(traj.response_ids[start:i])
            start = None
    specials = [t.content for t in tok.added_tokens_decoder.values() if t.special]
    for seg, results in zip(segments, turn_results(traj), strict=True):
        text = tok.decode(seg, skip_special_tokens=False)
        assert text.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n") or text.startswith("\n<|im_start|>user\n")
        assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
        template = (text[:text.index("\n<tool_response>\n")] + "".join(f"\n<tool_response>\n{TEXT_MARKER}\n</tool_response>" for _ in results)
                    + "<|im_end|>\n<|im_start|>assistant\n")
        assert seg == env.encode_rendered(template, results)
        if not any(special in r for r in results for special in specials):
            assert seg == tok.encode(text, add_special_tokens=False)
    # the whole row is what the chat template renders for the conversation
    decoded = tok.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False)
    tail = "\n" if traj.response_ids[-1] == tok.eos_token_id else "<|im_end|>\n"
    assert env.render(traj.messages) == decoded + tail


def turn_results(traj):
    """The tool results of each turn that has some, from the conversation."""
    turns = []
    for m in traj.messages[len(traj.sample["messages"]):]:
        if m["role"] == "assistant":
            turns.append([])
        elif m["role"] == "tool":
            turns[-1].append(m["content"])
    return [results for results in turns if results]


def test_trajectories_are_token_exact(greedy_trajs, engine, env):
    sampled = run_agent(engine, env, samples() * 2, SamplingConfig(max_new_tokens=48, temperature=1.0), max_turns=4, max_context_tokens=MAX_CONTEXT)
    for traj in list(greedy_trajs.values()) + sampled:
        check_token_exact(traj, env)
    assert any(c.error for t in greedy_trajs.values() for c in t.tool_calls)  # including after tool errors


def test_action_tokens_are_what_the_engine_samples(greedy_trajs, engine):
    for traj in greedy_trajs.values():
        for s, e in traj.turn_spans:
            [replay] = engine.generate([traj.prompt_ids + traj.response_ids[:s]], GREEDY, [e - s])
            assert replay.token_ids == traj.response_ids[s:e]


def trainer_logprobs(model, traj, temperature):
    ids = torch.tensor([traj.prompt_ids + traj.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(traj.prompt_ids) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(traj.response_ids)[:, None]).squeeze(-1)


def test_engine_logprobs_match_transformers(engine, env, scripted_dir):
    model = AutoModelForCausalLM.from_pretrained(scripted_dir, dtype=torch.float32)
    trajs = run_agent(engine, env, samples(), SamplingConfig(max_new_tokens=48, temperature=0.7), max_turns=3, max_context_tokens=MAX_CONTEXT)
    for traj in trajs:
        mask = torch.tensor(traj.action_mask, dtype=torch.bool)
        engine_lp = torch.tensor(traj.rollout_logprobs)
        assert torch.all(engine_lp[~mask] == 0)
        diff = (engine_lp - trainer_logprobs(model, traj, 0.7))[mask].abs().max().item()
        assert diff <= 1e-4, (traj.sample["id"], diff)


def last_k_env(env, keep_turns):
    """The same environments (the same tools, run by the same runner) with a context per step."""
    return ChatEnv(env.make, env.tokenizer, env.schemas, env.max_obs_tokens, context="last_k", keep_turns=keep_turns)


def visible_turns(traj, turn, keep_turns):
    """The conversation turn `turn` should have seen under last_k, rebuilt from the messages by hand:
    the prompt's messages, then the last keep_turns (assistant message + its tool results) groups."""
    n_prompt = len(traj.sample["messages"])
    groups = []
    for m in traj.messages[n_prompt:]:
        if m["role"] == "assistant":
            groups.append([])
        groups[-1].append(m)
    return traj.sample["messages"] + [m for g in groups[max(0, turn - keep_turns):turn] for m in g]


def test_last_k_context_is_token_exact_per_step_and_bounded(engine, env, scripted_dir):
    """rollout.context=last_k: each turn is sampled from the prompt the environment renders for it
    (the system prompt, the question, the last K turns) and trained as the pair (that prompt, the
    ids it sampled): the greedy engine replays every action from its prompt, the trainer's
    logprobs over the pair are the engine's, and on the endless-calculation script, which needs
    more turns than K, the prompt stops growing while the full context keeps growing."""
    tok, K = env.tokenizer, 1
    lastk = last_k_env(env, K)
    model = AutoModelForCausalLM.from_pretrained(scripted_dir, dtype=torch.float32)
    greedy = run_agent(engine, lastk, samples(), GREEDY, max_turns=6, max_context_tokens=MAX_CONTEXT)
    sampled = run_agent(engine, lastk, samples(), SamplingConfig(max_new_tokens=48, temperature=0.7), max_turns=6,
                        max_context_tokens=MAX_CONTEXT, seed=3)
    for traj in greedy + sampled:
        assert len(traj.step_prompts) == len(traj.turn_spans) and all(traj.action_mask)  # actions only: observations live in prompts
        for turn, prompt in enumerate(traj.step_prompts):
            visible = visible_turns(traj, turn, K)
            assert tok.decode(prompt, skip_special_tokens=False) == env.render(visible, add_generation_prompt=True)
            assert prompt == lastk.prompt_ids(visible)  # tool results as text (test_tools), which may quote a special token
    for traj in greedy:  # the engine samples the same action again from the step's prompt
        rows = traj.sequences()
        # the first K + 1 turns' prompts go on from the turn before: one row; each later turn's leaves one out
        assert [len(spans) for *_, spans, _ in rows] == [min(len(traj.turn_spans), K + 1)] + [1] * (len(traj.turn_spans) - K - 1)
        for ids, mask, _, spans, _ in rows:
            assert [i for i, m in enumerate(mask) if m] == [i for s, e in spans for i in range(s, e)]
            for s, e in spans:
                [replay] = engine.generate([ids[:s]], GREEDY, [e - s])
                assert replay.token_ids == ids[s:e]
    for traj in sampled:  # the trainer's logprobs over each row are the engine's
        for ids, mask, logprobs, _, _ in traj.sequences():
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, :-1].float() / 0.7
            trainer = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
            actions = torch.tensor(mask[1:], dtype=torch.bool)
            assert (torch.tensor(logprobs[1:]) - trainer)[actions].abs().max() <= 1e-4
    assert sum(len(t.turn_spans) > K for t in sampled) >= 2
    endless = greedy[list(scripted.SCRIPTS).index("Keep calculating.")]
    assert endless.finish_reason == "max_turns" and len(endless.turn_spans) == 6 > K
    lengths = [len(p) for p in endless.step_prompts]
    assert lengths[0] < lengths[1] and len(set(lengths[1:])) == 1  # the question, then the question and the last turn
    [full] = run_agent(engine, env, [samples()[list(scripted.SCRIPTS).index("Keep calculating.")]], GREEDY, max_turns=6,
                       max_context_tokens=MAX_CONTEXT)
    full_lengths = [len(full.prompt_ids) + s for s, _ in full.turn_spans]
    assert full_lengths[:2] == lengths[:2] and full_lengths[-1] > 2 * lengths[-1] - full_lengths[0]  # full keeps growing
    # a context budget counts the step's prompt, not the whole trajectory: one that the full context
    # outgrows on its fourth turn lets last_k run all six
    budget = full_lengths[3]
    [cut] = run_agent(engine, env, [full.sample], GREEDY, max_turns=6, max_context_tokens=budget)
    [bounded] = run_agent(engine, lastk, [full.sample], GREEDY, max_turns=6, max_context_tokens=budget)
    assert cut.finish_reason == "context_budget" and bounded.finish_reason == "max_turns" and len(bounded.turn_spans) == 6


def test_last_k_that_keeps_every_turn_sees_the_full_context(engine, env, greedy_trajs):
    """With K at least the number of turns nothing is left out, and each turn's freshly rendered
    prompt is token for token the full context's row before that turn."""
    lastk = run_agent(engine, last_k_env(env, 6), samples(), GREEDY, max_turns=4, max_context_tokens=MAX_CONTEXT)
    for traj in lastk:
        full = greedy_trajs[traj.sample["id"]]
        assert [full.prompt_ids + full.response_ids[:s] for s, _ in full.turn_spans] == traj.step_prompts
        assert [full.response_ids[s:e] for s, e in full.turn_spans] == [traj.response_ids[s:e] for s, e in traj.turn_spans]


def test_load_weights_switches_generation_and_logprobs(engine, env, tiny_model_dir, scripted_dir):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    memorised = AutoModelForCausalLM.from_pretrained(scripted_dir, dtype=torch.float32)
    prompt = env.prompt_ids(scripted.user("Compute 12*7."))
    try:
        engine.load_weights(base.state_dict().items())
        [gen] = engine.generate([prompt], SamplingConfig(max_new_tokens=16, greedy=True))
        expected = base.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=engine.stop_ids)[0, len(prompt):].tolist()
        assert gen.token_ids == expected  # the random base model's greedy continuation, not the memorised call
        with torch.no_grad():
            logits = base(torch.tensor([prompt + gen.token_ids])).logits[0, len(prompt) - 1:-1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(gen.token_ids)[:, None]).squeeze(-1)
        assert (torch.tensor(gen.logprobs) - ref).abs().max().item() <= 1e-4
    finally:
        engine.load_weights(memorised.state_dict().items())
    [back] = engine.generate([prompt], GREEDY)
    assert env.tokenizer.decode(back.token_ids).startswith("<tool_call>")


def test_a_paused_trajectory_goes_on_under_new_weights_token_exactly(engine, env, tiny_model_dir,
                                                                     scripted_dir):
    """
    A partial rollout (nanoagent/partial.py): pause() aborts the turns in the engine mid-way, keeping what
    each sampled, and the next run goes on from there under new weights. Each row stays token-exact, the
    paused turn is what the two versions sampled, in order, each token's logprob is that of the weights
    that sampled it (the continuation was conditioned on exactly the row so far), and its version is
    recorded.
    """
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    memorised = AutoModelForCausalLM.from_pretrained(scripted_dir, dtype=torch.float32)
    rollouts = Rollouts(engine, env, SamplingConfig(max_new_tokens=48, temperature=1.0), max_turns=4,
                        max_context_tokens=MAX_CONTEXT)
    trajs = rollouts.start(samples() * 2, seed=3)
    engine_steps = itertools.count(1)
    rollouts.run(lambda: next(engine_steps) == 4)  # a few tokens into every first turn
    rollouts.pause()
    paused = [list(t.partial[0]) for t in trajs]
    assert not rollouts.generating and all(paused) and not any(t.finish_reason for t in trajs)
    try:
        engine.load_weights(base.state_dict().items())
        rollouts.version = 1
        rollouts.run()
    finally:
        engine.load_weights(memorised.state_dict().items())
    for t, before in zip(trajs, paused):
        assert t.finish_reason and t.partial == ((), (), ()) and t.pieces == 0
        check_token_exact(t, env)
        s, e = t.turn_spans[0]
        assert t.response_ids[s:s + len(before)] == before
        mask = torch.tensor(t.action_mask, dtype=torch.bool)
        versions = torch.tensor(t.versions)
        assert versions[mask].tolist() == [0] * len(before) + [1] * (int(mask.sum()) - len(before))
        expected = torch.where(versions == 0, trainer_logprobs(memorised, t, 1.0),
                               trainer_logprobs(base, t, 1.0))
        assert (torch.tensor(t.rollout_logprobs) - expected)[mask].abs().max() <= 1e-4


def test_hf_fallback_engine_gives_the_same_trajectories(greedy_trajs, env, scripted_dir):
    tok = env.tokenizer
    hf = HFEngine(scripted_dir, stop_token_ids(tok), tok.pad_token_id, dtype="float32")
    for traj in run_agent(hf, env, samples(), GREEDY, max_turns=4, max_context_tokens=MAX_CONTEXT):
        ref = greedy_trajs[traj.sample["id"]]
        assert traj.response_ids == ref.response_ids and traj.action_mask == ref.action_mask
        assert traj.finish_reason == ref.finish_reason
        mask = torch.tensor(traj.action_mask, dtype=torch.bool)
        assert (torch.tensor(traj.rollout_logprobs) - torch.tensor(ref.rollout_logprobs))[mask].abs().max() <= 1e-4


def test_multi_turn_search_over_a_built_index(engine, env, tools, index_dir):
    """The memorised model searches the on-disk index (IndexRetriever: FAISS file, memmapped
    document store), reads the result in the next turn and answers: the same trajectory as with
    the in-memory retriever it was trained against, scored by the task's reward."""
    search = make_tools(["search"], index_dir, top_k=1)[0]
    disk = tool_env([tools["calculator"], tools["sleep"], search], env.tokenizer, env.max_obs_tokens, TIMEOUT_S)
    sample = {"id": "q", "messages": scripted.user("Who founded Nanotown?"), "answers": ["Ada Quill"]}
    [t] = run_agent(engine, disk, [sample], GREEDY, max_turns=4, max_context_tokens=MAX_CONTEXT)
    [ref] = run_agent(engine, env, [sample], GREEDY, max_turns=4, max_context_tokens=MAX_CONTEXT)
    [call] = t.tool_calls
    assert call.name == "search" and not call.error
    assert call.result == "Doc 1 (Title: Nanotown) Nanotown is a river city founded by Ada Quill in 1802."
    assert t.finish_reason == "done" and len(t.turn_spans) == 2 and t.response_ids == ref.response_ids
    check_token_exact(t, disk)
    assert score_trajectory(t) == 1.0 and t.scores == {"em": 1.0, "substring_em": 1.0, "f1": 1.0, "format": 1.0}


def test_rollout_cli_writes_trajectories_and_metrics(scripted_dir, index_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    with open(data, "w") as f:
        for q, answer in [("Compute 12*7.", "84"), ("Say hi.", "hi"), ("Who founded Nanotown?", "Ada Quill")]:
            f.write(json.dumps({"id": q, "messages": scripted.user(q), "answers": [answer]}) + "\n")
    out, out_last_k = tmp_path / "rollouts.jsonl", tmp_path / "rollouts_last_k.jsonl"
    common = ["--model", scripted_dir, "--data", str(data), "--tools", "calculator,search", "--index", index_dir, "--greedy",
              "--config", "tiny", "rollout.max_turns=3", "reward.format_weight=0.5"]
    commands = [["--out", str(out), *common],
                # a context per step: each trajectory also holds the prompt each turn was sampled from (the fallback engine)
                ["--out", str(out_last_k), *common, "rollout.engine=hf", "rollout.context=last_k", "rollout.keep_turns=1"],
                ["--model", scripted_dir, "--data", str(tmp_path / "missing.parquet")]]
    with ThreadPoolExecutor(max_workers=3) as pool:  # independent runs, side by side
        proc, proc_last_k, bad = pool.map(lambda args: procs.run([sys.executable, "rollout.py", *args], capture_output=True,
                                                                 text=True, timeout=600), commands)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["Compute 12*7.", "Say hi.", "Who founded Nanotown?"]
    for r in rows:
        assert len(r["response_ids"]) == len(r["action_mask"]) == len(r["rollout_logprobs"])
        assert r["finish_reason"] in ("done", "truncated", "context_budget", "max_turns") and set(r["scores"]) == {"em", "substring_em", "f1", "format"}
        assert r["reward"] == r["scores"]["em"] + 0.5 * r["scores"]["format"]
        # each turn's sampled tokens as text, for the viewer: they join into the turn's decoded text
        turns = ["".join(texts) for texts in r["turn_tokens"]]
        assert len(turns) == r["turns"] and all(turn in r["response_text"] for turn in turns)
    assert report.main([f"--trajectories={out}"]) == 0  # the viewer of rollout.py's output, beside it
    assert "rollout.py: the first 3 of 3 trajectories" in (tmp_path / "rollouts.html").read_text()
    assert "em " in proc.stdout and "format " in proc.stdout and "finish/done" in proc.stdout and "action_tokens_per_s" in proc.stdout
    assert proc_last_k.returncode == 0, proc_last_k.stderr[-3000:]
    last_k = [json.loads(line) for line in out_last_k.read_text().splitlines()]
    assert [r["scores"] for r in last_k] == [r["scores"] for r in rows]  # two turns at most: K=1 leaves nothing out
    for r in last_k:
        assert len(r["step_prompt_ids"]) == r["turns"] and r["step_prompt_ids"][0] == r["prompt_ids"] and all(r["action_mask"])
    assert bad.returncode != 0 and "does not exist" in bad.stderr


def test_seeded_sampling_of_a_batch_longer_than_one_step(engine):
    """More prompt tokens than vLLM schedules in one step, each request with its own seed: on the
    CPU a prefill split over two steps crashed the seeded sampler. Same seeds, same samples."""
    prompts = [[5 + (i * 7 + j) % 300 for j in range(MAX_CONTEXT - 64)] for i in range(6)]
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0)
    first = engine.generate(prompts, sampling, seeds=list(range(6)))
    again = engine.generate(prompts, sampling, seeds=list(range(6)))
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert all(len(g.token_ids) >= 1 for g in first)


def with_latency(env, tools, delay):
    """The same tools, the i-th call (counted over all tools) answering after delay(i) seconds."""
    calls = itertools.count()

    def slowed(tool):
        def call(arguments):
            time.sleep(delay(next(calls)))
            return tool.call(arguments)
        return Tool(tool.name, tool.description, tool.parameters, call)
    return tool_env([slowed(t) for t in tools.values()], env.tokenizer, env.max_obs_tokens, TIMEOUT_S)


def test_trajectories_do_not_depend_on_when_tools_answer(engine, env, tools, monkeypatch):
    """Each trajectory is scheduled on its own and samples turn k with a seed of its own: the same
    batch rolled out twice, with tools that answer at once and with the first call held back a
    second (so the engine runs the turns in other orders and batches: its trajectory's next turn
    comes after the others'), gives the same trajectories."""
    orders = []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda request_id, *args: (orders[-1].append(request_id), submit(request_id, *args))[1])
    batch = [s for s in samples() if s["id"] != "Wait a long time."] * 3
    runs = []
    for delay in (lambda i: 0.0, lambda i: 1.0 if i == 0 else 0.0):
        orders.append([])
        runs.append(run_agent(engine, with_latency(env, tools, delay), batch, SamplingConfig(max_new_tokens=48, temperature=1.0),
                              max_turns=4, max_context_tokens=MAX_CONTEXT, seed=11))
    assert sum(len(t.turn_spans) for t in runs[0]) > len(batch) + 1  # tools were called, more than once
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1])  # other schedules, the same requests
    for a, b in zip(*runs):
        assert (a.response_ids, a.action_mask, a.finish_reason) == (b.response_ids, b.action_mask, b.finish_reason)
        torch.testing.assert_close(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def tagging_qwen_dir(qwen_model_dir, tmp_path_factory):
    """
    The random model under Qwen2.5's real vocabulary, made to write <tool_call>, </tool_call> and
    <|im_end|> among its random tokens, and single bytes often. Every embedding row (tied to the LM
    head) gets the same first coordinate, which the residual stream carries up to dominate the last
    normalised hidden state; the three tags get a larger one, the 256 single-byte tokens a somewhat
    larger one, and the padding rows past the tokenizer's last token (no token at all) a negative
    one. So sampled turns open calls (malformed: their bodies are random tokens), stop on
    </tool_call> or EOS or run out of budget, and error observations follow; and actions are often
    not what their decoded text encodes to (bytes that BPE merges, halves of characters), so a turn
    that re-encoded its history would see other ids than the ones that were sampled.
    """
    tok = AutoTokenizer.from_pretrained(qwen_model_dir)
    model = AutoModelForCausalLM.from_pretrained(qwen_model_dir, dtype=torch.float32)
    with torch.no_grad():
        first = model.model.embed_tokens.weight[:, 0]  # [V]
        first.fill_(1.0)
        first[:256] = 1.5
        first[tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>", "<|im_end|>"])] = 1.9
        first[len(tok):] = -1.0
    path = str(tmp_path_factory.mktemp("tagging_qwen"))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def qwen_engine(tagging_qwen_dir):
    """The real vLLM CPU engine on the Qwen-vocabulary model; the torch.distributed world of one it
    sets up goes with it (make test's workers run other modules' tests in this process after this). Eager, to start
    faster."""
    engine = VLLMEngine(tagging_qwen_dir, stop_token_ids(AutoTokenizer.from_pretrained(tagging_qwen_dir)), MAX_CONTEXT, dtype="float32", seed=0,
                        compile=False)
    yield engine
    del engine
    from vllm.distributed import cleanup_dist_env_and_memory  # here: the GPU machine collects this module without vLLM
    cleanup_dist_env_and_memory()


def test_trajectories_are_token_exact_under_qwens_vocabulary(tagging_qwen_dir, qwen_engine, monkeypatch):
    """
    Sampled multi-turn trajectories under Qwen2.5's tokenizer, template and stop ids, through the
    real vLLM engine: each turn's prompt is the ids sampled and observed so far (never re-encoded,
    though here that would change them), observations are the template's canonical tokens where
    Qwen's merges reach across a result's edge (".\\n" is one token), every turn stops right after
    </tool_call> or EOS, and the trainer's forward gives the logprobs the engine sampled with.
    """
    tok = AutoTokenizer.from_pretrained(tagging_qwen_dir)
    # No tools: the calls' bodies are random tokens, so every call is malformed whatever the tools, and
    # without their schemas the rows are short and the trainer's forward over 151,936 logits cheap.
    # No system message either: Qwen's template puts in its default one.
    env = tool_env([], tok, max_obs_tokens=64)
    stop = stop_token_ids(tok)
    assert stop == sorted(tok.convert_tokens_to_ids(["<|im_end|>", "</tool_call>"]))
    engine = qwen_engine
    sent = []  # every prompt the engine was given
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda request_id, prompt_ids, *args: (sent.append(prompt_ids), submit(request_id, prompt_ids, *args))[1])
    sampling = SamplingConfig(max_new_tokens=16, temperature=0.8)
    prompts = [{"id": i, "messages": [{"role": "user", "content": f"What is {i}*7?"}]} for i in range(8)]
    trajs = run_agent(engine, env, prompts, sampling, max_turns=4, max_context_tokens=MAX_CONTEXT, seed=0)

    turns = [(t.prompt_ids + t.response_ids[:s], t.response_ids[s:e]) for t in trajs for s, e in t.turn_spans]
    assert sorted(sent) == sorted(history for history, _ in turns)  # token-in/token-out
    earlier = [t.response_ids[s:e] for t in trajs for s, e in t.turn_spans[:-1]]  # actions that later prompts hold
    assert any(tok.encode(tok.decode(a, skip_special_tokens=False), add_special_tokens=False) != a for a in earlier)
    for traj in trajs:
        check_token_exact(traj, env)
    observed = {i for t in trajs for i, m in zip(t.response_ids, t.action_mask) if m == 0}
    assert tok.convert_tokens_to_ids(".Ċ") in observed  # Qwen's merge across the end of a result ("...</tool_call>.")
    results = [c.result for t in trajs for c in t.tool_calls]
    assert any("invalid JSON" in r for r in results) and any("was not closed" in r for r in results)
    for _, action in turns:
        assert not set(action[:-1]) & set(stop), tok.decode(action)  # a turn ends at its first stop id
        assert action[-1] in stop or len(action) == sampling.max_new_tokens
    assert {a[-1] if a[-1] in stop else "length" for _, a in turns} == set(stop) | {"length"}

    batch = collate(trajs, tok.pad_token_id)
    model = load_policy(tagging_qwen_dir)
    logprobs = forward_all(lambda *packed: policy_forward(model, *packed, sampling.temperature)[0],
                           batch, list(range(len(trajs))), 100_000, torch.device("cpu"))
    mask = batch["action_mask"].bool()
    torch.testing.assert_close(batch["rollout_logprobs"][mask], logprobs[mask], atol=1e-4, rtol=0)
