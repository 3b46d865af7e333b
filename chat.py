"""
Talk to a trained agent in the terminal and watch it work: its reasoning, each tool call (name and
arguments), each tool result and the final answer, in separate panels.

    python chat.py --model out/run/hf --index data/hotpotqa/index
    python chat.py --model out/run/hf --index data/hotpotqa/index --question "Who directed ...?"   # once
    python chat.py --model out/tiny/hf --tools calculator --question "What is 7 * 8?"

Each answer is one run of the same multi-turn loop, tool environment and chat template as training
(nanoagent/agent.py: run_agent), so what you see is what RL optimised. The conversation carries
over: the next question is appended to the messages so far. Ctrl-C or Ctrl-D (end of input) leaves.
"""

import argparse
import json
import os
import re
import sys

THINK_RE = re.compile(r"<think>(.*?)</think>", re.DOTALL)
TOOL_CALL_RE = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)


def fail(message):
    print(f"chat.py: {message}", file=sys.stderr)
    sys.exit(2)


def show_turns(console, messages, calls):
    """Panels for the assistant turns and tool results of one answer (messages after the question)."""
    from rich.panel import Panel
    from rich.text import Text

    from nanoagent.reward import extract_answer
    calls = iter(calls)
    for m in messages:
        if m["role"] == "assistant":
            content = m["content"]
            for thought in THINK_RE.findall(content):
                console.print(Panel(Text(thought.strip()), title="thinking", border_style="dim", style="dim"))
            for _ in TOOL_CALL_RE.findall(content):
                call = next(calls, None)
                if call is None:
                    break
                args = json.dumps(call.arguments, ensure_ascii=False) if call.arguments is not None else "(unparsable)"
                console.print(Panel(Text(f"{call.name}({args})"), title="tool call", border_style="yellow"))
                console.print(Panel(Text(call.result), title="error" if call.error else f"{call.name} result",
                                    border_style="red" if call.error else "blue"))
            answer = extract_answer(content)
            if answer is not None:
                console.print(Panel(Text(answer), title="answer", border_style="green"))
            elif not TOOL_CALL_RE.search(content):
                rest = TOOL_CALL_RE.sub("", THINK_RE.sub("", content)).strip()
                if rest:
                    console.print(Panel(Text(rest), title="reply (no <answer> tag)", border_style="magenta"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="exported checkpoint folder (<run_dir>/hf), hub id, or 'tiny'")
    parser.add_argument("--index", default=None, help="search index folder from build_index.py (enables the search tool)")
    parser.add_argument("--tools", default=None, help="comma-separated tools: search, calculator (default: search with --index, else calculator)")
    parser.add_argument("--system", default=None, help="system prompt (default: the training prompt of the task the tools belong to)")
    parser.add_argument("--question", default=None, help="answer this one question and exit")
    parser.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto", help="generation engine (auto: vLLM where installed)")
    parser.add_argument("--max-turns", type=int, default=6, help="assistant turns per answer")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="tokens per turn")
    parser.add_argument("--max-context", type=int, default=8192, help="token budget of the whole conversation (at most the model's)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    args = parser.parse_args(argv)

    tools = [t for t in (args.tools or ("search" if args.index else "calculator")).split(",") if t]
    if "search" in tools and not args.index:
        fail("the search tool needs --index (a folder from build_index.py)")
    if args.index and not os.path.exists(os.path.join(args.index, "meta.json")):
        fail(f"--index {args.index!r} is not a search index (no meta.json); build one with build_index.py")
    if os.path.sep in args.model or args.model.startswith("."):
        if not os.path.isdir(args.model):
            fail(f"--model {args.model!r} does not exist (an exported run has <run_dir>/hf)")

    import torch
    from rich.console import Console
    from transformers import AutoConfig, AutoTokenizer

    from nanoagent.agent import run_agent
    from nanoagent.common import resolve_model
    from nanoagent.data import ARITHMETIC_SYSTEM
    from nanoagent.engine import SamplingConfig, make_engine
    from nanoagent.hotpotqa import SEARCH_SYSTEM
    from nanoagent.tools import ToolEnv, make_tools

    model_path = resolve_model(args.model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        fail(f"cannot load a tokenizer from --model {args.model!r}: {str(e).splitlines()[0]}")
    if not tokenizer.chat_template:
        fail(f"{args.model} has no chat template; nanoagent renders conversations and tool results with it")
    try:
        env = ToolEnv(make_tools(tools, args.index), tokenizer)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    config = AutoConfig.from_pretrained(model_path)
    max_context = min(args.max_context, getattr(config, "max_position_embeddings", None) or args.max_context)
    console = Console()
    with console.status("loading the model"):
        engine = make_engine(args.engine, model_path, tokenizer, max_context,
                             "bfloat16" if torch.cuda.is_available() else "float32")
    sampling = SamplingConfig(args.max_new_tokens, args.temperature or 1.0, greedy=args.temperature == 0)
    system = args.system or (SEARCH_SYSTEM if "search" in tools else ARITHMETIC_SYSTEM)
    messages = [{"role": "system", "content": system}]

    def answer(question):
        nonlocal messages
        asked = messages + [{"role": "user", "content": question}]
        [traj] = run_agent(engine, env, [{"id": "chat", "messages": asked, "answers": []}], sampling,
                           args.max_turns, max_context)
        show_turns(console, traj.messages[len(asked):], traj.tool_calls)
        if traj.finish_reason != "answer":
            console.print(f"[dim](stopped: {traj.finish_reason})[/dim]")
        messages = traj.messages

    if args.question is not None:
        answer(args.question)
        return 0
    console.print(f"[bold]nanoagent chat[/bold] with {args.model} (tools: {', '.join(tools) or 'none'}). Ctrl-D or Ctrl-C to leave.")
    try:
        while True:
            question = console.input("[bold cyan]you>[/bold cyan] ").strip()
            if question:
                answer(question)
    except (EOFError, KeyboardInterrupt):
        console.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
