"""
Rollout speed on this machine (prints figures; asserts nothing).

    python bench/bench_rollout.py

1. The agent loop against raw generation, for the same trajectories. The model is the tiny model
   after memorising the scripted tool-using conversations of tests/scripted.py, so trajectories
   really call tools (calculator, batched search) over one to three turns; sampling is seeded per
   trajectory and turn, so both loops roll out exactly the same trajectories (checked). Reported:
   - raw generation: each trajectory's action tokens sampled in one request from its prompt
     (min_tokens = max_tokens), all together: what the engine does without any agent loop;
   - the old loop, batch per turn (kept here as the baseline): all live trajectories generate a
     turn together, then all their environments step (their tool calls run), then the next turn starts;
   - the new loop, nanoagent.agent.run_agent: each trajectory scheduled on its own;
   with tools that answer at once and with tools that answer after 0-200 ms (drawn per call from
   a fixed seed and the call's arguments, so a call waits as long in both loops), and the engine's
   idle fraction (the share of the loop's time with nothing to generate, waiting for environments).
2. VLLMEngine.load_weights: one call handing vLLM an iterator over all tensors, against one
   reload call per parameter (the "storm" it avoids), for the tiny model and a ~80M model.
Medians of several runs, in one process.
"""

import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import wait

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import scripted  # noqa: E402
from nanoagent.agent import Rollouts, observe, start_trajectories, take_turn, turn_seed  # noqa: E402
from bench.timing import median_time  # noqa: E402
from nanoagent.engine import SamplingConfig, VLLMEngine, stop_token_ids  # noqa: E402
from nanoagent.env import tool_env  # noqa: E402
from nanoagent.retriever import InMemoryRetriever, load_encoder, packaged_minilm_path  # noqa: E402
from nanoagent.tiny import build_tiny_model  # noqa: E402
from nanoagent.tools import Tool, calculator_tool, search_tool  # noqa: E402

REPEATS = 5
MAX_TURNS, MAX_CONTEXT, SEED, TIMEOUT_S = 4, 2048, 7, 2.0


def batch_per_turn(engine, env, samples, sampling, max_turns, max_context_tokens, seed=None, timing=None):
    """The loop run_agent replaced: every turn, all live trajectories generate together, then all
    their environments step together (the turn's tool calls run), then the next turn. Same interface
    and trajectories as run_agent."""
    trajs = start_trajectories(env, samples, max_context_tokens)
    live, engine_s, idle_s = list(range(len(trajs))), 0.0, 0.0
    for turn in range(max_turns):
        prompts = [trajs[i].next_prompt_ids() for i in live]
        budgets = [min(sampling.max_new_tokens, max_context_tokens - len(p)) for p in prompts]
        start = time.perf_counter()
        gens = engine.generate(prompts, sampling, budgets, [turn_seed(seed, i, turn) for i in live])
        engine_s += time.perf_counter() - start
        actions = [(i, gen.finish_reason, budget,
                    *take_turn(trajs[i], gen.token_ids, gen.logprobs, env.tokenizer))
                   for i, gen, budget in zip(live, gens, budgets)]
        start = time.perf_counter()
        steps = [(i, env.start(trajs[i].env, content), content, eos,
                  None if finish != "length"
                  else "context_budget" if budget < sampling.max_new_tokens else "truncated")
                 for i, finish, budget, content, eos in actions]
        wait([step for _, step, *_ in steps])
        idle_s += time.perf_counter() - start
        live = [i for i, step, content, eos, cut in steps
                if observe(trajs[i], env, step, content, eos, turn == max_turns - 1, cut, max_context_tokens)]
    timing.update(engine_s=engine_s, idle_s=idle_s)
    return trajs


def with_latency(env, tools, most, seed):
    """The same tools, each call answering after a delay in [0, most) s drawn from (seed, its
    arguments); a batch of calls answers after the longest of their delays."""
    def delay(arguments):
        return random.Random(f"{seed}-{json.dumps(arguments, sort_keys=True)}").uniform(0, most)

    def slowed(tool):
        def call(arguments):
            time.sleep(delay(arguments))
            return tool.call(arguments)

        def call_batch(arguments):
            time.sleep(max(map(delay, arguments)))
            return tool.call_batch(arguments)
        return Tool(tool.name, tool.description, tool.parameters, call,
                    call_batch if tool.call_batch else None)
    return tool_env([slowed(t) for t in tools], env.tokenizer, env.max_obs_tokens, TIMEOUT_S)


def raw_generation(engine, trajs):
    """Each trajectory's action tokens, sampled in one request from its prompt, all together."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=1.0, logprobs=0,
                             detokenize=False)
              for n in (sum(t.action_mask) for t in trajs)]
    engine.llm.generate([TokensPrompt(prompt_token_ids=t.prompt_ids) for t in trajs], params, use_tqdm=False)


def per_trajectory(engine, env, samples, sampling, max_turns, max_context_tokens, seed=None, timing=None):
    """nanoagent's loop (agent.Rollouts: what run_agent runs), with its time waiting on environments."""
    rollouts = Rollouts(engine, env, sampling, max_turns, max_context_tokens)
    trajs = rollouts.start(samples, seed)
    rollouts.run()
    timing.update(engine_s=rollouts.engine_s, idle_s=rollouts.idle_s)
    return trajs


def bench_loops(engine, env, tools, copies):
    samples = [{"id": q, "messages": scripted.user(q)}
               for q in scripted.SCRIPTS if q != "Wait a long time."] * copies
    sampling = SamplingConfig(max_new_tokens=64, temperature=1.0)
    loops = {"old": batch_per_turn, "new": per_trajectory}
    print(f"agent loop: {len(samples)} trajectories, max {MAX_TURNS} turns, seeded sampling at temperature 1")
    print(f"{'tools':>9} | {'raw gen':>7} | {'old loop':>8} {'x raw':>6} {'idle':>5} | "
          f"{'new loop':>8} {'x raw':>6} {'idle':>5} | new vs old")
    for label, run_env in [("at once", env), ("0-200 ms", with_latency(env, tools, 0.2, SEED))]:
        times, idle, trajs = {"raw": [], "old": [], "new": []}, {"old": [], "new": []}, {}
        for repeat in range(REPEATS + 1):  # the first is a warm-up
            for name, loop in loops.items():
                timing = {}
                start = time.perf_counter()
                trajs[name] = loop(engine, run_env, samples, sampling, MAX_TURNS, MAX_CONTEXT, seed=SEED,
                                   timing=timing)
                seconds = time.perf_counter() - start
                if repeat:
                    times[name].append(seconds)
                    idle[name].append(timing["idle_s"] / seconds)
            start = time.perf_counter()
            raw_generation(engine, trajs["new"])
            if repeat:
                times["raw"].append(time.perf_counter() - start)
        same = all((a.response_ids, a.action_mask) == (b.response_ids, b.action_mask)
                   for a, b in zip(trajs["old"], trajs["new"]))
        raw, old, new = (statistics.median(times[k]) for k in ("raw", "old", "new"))
        tokens = sum(sum(t.action_mask) for t in trajs["new"])
        turns = sum(len(t.turn_spans) for t in trajs["new"]) / len(samples)
        print(f"{label:>9} | {raw:6.2f}s | "
              f"{old:7.2f}s {old / raw:5.2f}x {statistics.median(idle['old']):5.0%} | "
              f"{new:7.2f}s {new / raw:5.2f}x {statistics.median(idle['new']):5.0%} | {old / new:.2f}x faster"
              f"   ({tokens} action tokens, {turns:.2f} turns each, "
              f"same trajectories in both loops: {'yes' if same else 'NO'})")


def bench_reload(engine, model_dir, label):
    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    n_params = sum(t.numel() for t in state.values())
    one_call = median_time(lambda: engine.load_weights(state.items()), 5)
    per_param = median_time(lambda: [engine.llm.collective_rpc("reload_weights",
                                                               kwargs={"weights_iterator": iter([kv])})
                                     for kv in state.items()], 3)
    print(f"load_weights {label} ({n_params / 1e6:.1f}M params, {len(state)} tensors): "
          f"one call {one_call * 1e3:.1f} ms | "
          f"one call per tensor {per_param * 1e3:.1f} ms ({per_param / one_call:.1f}x)")


def main():
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, cuda {torch.cuda.is_available()}")
    tmp = tempfile.mkdtemp()
    base = build_tiny_model(os.path.join(tmp, "tiny"))
    tok = AutoTokenizer.from_pretrained(base)
    retriever = InMemoryRetriever(scripted.CORPUS, load_encoder(packaged_minilm_path()))
    tools = [calculator_tool(), search_tool(retriever, 1)]
    env = tool_env(tools, tok, max_obs_tokens=64, timeout_s=TIMEOUT_S)
    model_dir, _ = scripted.memorise(base, os.path.join(tmp, "scripted"), env, steps=150)
    # as the CPU presets
    engine = VLLMEngine(model_dir, stop_token_ids(tok), 2048, dtype="float32", compile=False)
    bench_loops(engine, env, tools, copies=8)
    bench_reload(engine, model_dir, "tiny")
    del engine
    bigger = build_tiny_model(os.path.join(tmp, "bigger"), hidden_size=1024, num_layers=8)
    bench_reload(VLLMEngine(bigger, stop_token_ids(tok), 2048, dtype="float32", compile=False), bigger,
                 "hidden 1024 x 8 layers")


if __name__ == "__main__":
    main()
