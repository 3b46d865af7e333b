"""
Rollout speed on this machine (prints figures; asserts nothing).

    python bench/bench_rollout.py

1. The multi-turn loop's overhead: tokens/s of run_agent (generate, parse, run tools, render
   observations, next turn) against raw single-turn generation of the same number of tokens per
   trajectory from the same prompts (vLLM with min_tokens = max_tokens), same engine, same process.
   The model is the tiny model after memorising the scripted tool-using conversations of
   tests/scripted.py, so trajectories really call tools over several turns.
2. VLLMEngine.load_weights: one call handing vLLM an iterator over all tensors, against one
   reload call per parameter (the "storm" it avoids), for the tiny model and a ~80M model.
Medians of several runs.
"""

import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import scripted  # noqa: E402
from nanoagent.agent import run_agent  # noqa: E402
from nanoagent.common import median_time  # noqa: E402
from nanoagent.engine import SamplingConfig, VLLMEngine, stop_token_ids  # noqa: E402
from nanoagent.retriever import InMemoryRetriever, load_encoder, packaged_minilm_path  # noqa: E402
from nanoagent.tiny import build_tiny_model  # noqa: E402
from nanoagent.tools import ToolEnv, calculator_tool, search_tool  # noqa: E402

REPEATS = 3


def bench_loop(engine, env, copies):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    samples = [{"id": q, "messages": scripted.user(q)} for q in scripted.SCRIPTS if q != "Wait a long time."] * copies
    sampling = SamplingConfig(max_new_tokens=64, temperature=1.0)
    run_agent(engine, env, samples[:8], sampling, 4, 2048)  # warm-up
    loop_times, raw_times, tokens, turns = [], [], 0, 0
    for _ in range(REPEATS):
        start = time.perf_counter()
        trajs = run_agent(engine, env, samples, sampling, max_turns=4, max_context_tokens=2048)
        loop_times.append(time.perf_counter() - start)
        counts = [sum(t.action_mask) for t in trajs]
        tokens, turns = sum(counts), sum(len(t.turn_spans) for t in trajs) / len(trajs)
        params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=1.0, logprobs=0, detokenize=False) for n in counts]
        start = time.perf_counter()
        engine.llm.generate([TokensPrompt(prompt_token_ids=t.prompt_ids) for t in trajs], params, use_tqdm=False)
        raw_times.append(time.perf_counter() - start)
    loop, raw = statistics.median(loop_times), statistics.median(raw_times)
    print(f"multi-turn loop: {len(samples)} trajectories, {turns:.2f} turns each, {tokens} action tokens")
    print(f"  loop {tokens / loop:,.0f} tokens/s ({loop:.2f} s) | raw generation {tokens / raw:,.0f} tokens/s ({raw:.2f} s) | loop/raw time {loop / raw:.2f}x")


def bench_reload(engine, model_dir, label):
    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    n_params = sum(t.numel() for t in state.values())
    one_call = median_time(lambda: engine.load_weights(state.items()), 5)
    per_param = median_time(lambda: [engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter([kv])}) for kv in state.items()], 3)
    print(f"load_weights {label} ({n_params / 1e6:.1f}M params, {len(state)} tensors): one call {one_call * 1e3:.1f} ms | "
          f"one call per tensor {per_param * 1e3:.1f} ms ({per_param / one_call:.1f}x)")


def main():
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, cuda {torch.cuda.is_available()}")
    tmp = tempfile.mkdtemp()
    base = build_tiny_model(os.path.join(tmp, "tiny"))
    tok = AutoTokenizer.from_pretrained(base)
    retriever = InMemoryRetriever(scripted.CORPUS, load_encoder(packaged_minilm_path()))
    env = ToolEnv([calculator_tool(), search_tool(retriever, 1)], tok, max_obs_tokens=64, timeout_s=2.0)
    model_dir, _ = scripted.memorise(base, os.path.join(tmp, "scripted"), env, steps=150)
    engine = VLLMEngine(model_dir, stop_token_ids(tok), 2048, dtype="float32")
    bench_loop(engine, env, copies=16)
    bench_reload(engine, model_dir, "tiny")
    del engine
    bigger = build_tiny_model(os.path.join(tmp, "bigger"), hidden_size=1024, num_layers=8)
    bench_reload(VLLMEngine(bigger, stop_token_ids(tok), 2048, dtype="float32"), bigger, "hidden 1024 x 8 layers")


if __name__ == "__main__":
    main()
