"""
Talk to a trained agent in the terminal and watch it work: its reasoning, each tool call (name and
arguments), each tool result and the final answer, each in its own panel.

    python chat.py --model out/run/hf                          # the run's tools, index and budgets
    python chat.py --model out/demo/run/hf --question "Where was Rata Semam born?"   # once, then exit
    python chat.py --model Qwen/Qwen2.5-3B-Instruct --config hotpotqa --index data/hotpotqa/index
    python chat.py --model out/tiny/hf --tools calculator rollout.max_turns=2

An answer is one run of the very loop, tool environment and chat template that training rolled out
(nanoagent/agent.py: run_agent), with the tools, system prompt, question wording and budgets of the
training config, so what you watch is what RL optimised. That config is the run's own
(<run_dir>/config.json, next to the <run_dir>/hf export) unless --config names a preset, with
key=value overrides as in train.py. The conversation carries over: each question is appended to
the messages so far. Ctrl-C or Ctrl-D (end of input) leaves. When stdout is not a terminal (a pipe,
a file) the panels come out as plain text without colour, so --question is scriptable.
"""

import argparse
import json
import os
import re
import signal
import sys

from nanoagent.config import ConfigError, load_run_config, reference
from nanoagent.tasks import load_task, named_tools, task_env

THINK_TAG_RE = re.compile(r"</?think>")
# a tool call block: closed, or cut off by the token budget
CALL_BLOCK_RE = re.compile(r"<tool_call>.*?(?:</tool_call>|\Z)", re.DOTALL)
# C0 but tab and newline, DEL, C1, and the bidi controls (Unicode's Bidi_Control: marks, embeddings,
# overrides, isolates), which reorder the text shown after them (U+202E shows "abc" as "cba"): a reply
# could read as what it is not
CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
STOPPED = {  # why an answer ended without one, and the setting behind it
    "truncated": "the turn ran out of new tokens (rollout.max_new_tokens)",
    "context_budget": "the conversation reached the context budget (rollout.max_context_tokens)",
    "max_turns": "the agent used all its turns (rollout.max_turns)",
    "env_error": "the environment failed",
}


def fail(message):
    """A clear one-line error and a non-zero exit instead of a traceback."""
    print(f"chat.py: {message}", file=sys.stderr)
    sys.exit(2)


def printable(text):
    """
    Text from the model or a tool as the terminal may show it: every control character but tab and
    newline written out as an escape (ESC as \\x1b, RIGHT-TO-LEFT OVERRIDE as \\u202e), so that none
    moves the cursor, recolours the terminal, sets its title or reorders the text after it. Shown as
    rich Text, never as markup, so "[red]" stays "[red]".
    """
    return CONTROL_RE.sub(
        lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", text)


def ask(engine, env, messages, question, sampling, max_turns, max_context):
    """
    Answer one question: the agent loop over the conversation so far plus the question. Returns
    the trajectory; its messages are the conversation to continue. A conversation that no longer
    fits the context budget starts over from the system prompt: the trajectory's prompt then holds
    only the system prompt and the question.
    """
    from nanoagent.agent import run_agent
    asked = messages + [{"role": "user", "content": question}]
    if len(env.prompt_ids(asked)) >= max_context:
        restart = [m for m in messages[:1] if m["role"] == "system"] + asked[-1:]
        if len(env.prompt_ids(restart)) >= max_context:
            raise ValueError(f"the question alone is over the context budget of {max_context} tokens "
                             "(rollout.max_context_tokens)")
        asked = restart
    [traj] = run_agent(engine, env, [{"id": "chat", "messages": asked, "answers": []}], sampling, max_turns,
                       max_context)
    return traj


def show(console, traj, keep_turns=None):
    """The panels of one answer: for each assistant turn its reasoning, its tool calls with their
    results, and the answer; what the model or a tool wrote goes through printable. keep_turns:
    with rollout.context=last_k, each turn first says what it saw (the question and which earlier
    turns, in how many tokens)."""
    from rich.panel import Panel
    from rich.text import Text

    from nanoagent.reward import ANSWER_RE, extract_answer
    after = traj.messages[len(traj.sample["messages"]):]
    starts = [i for i, m in enumerate(after) if m["role"] == "assistant"]
    turns = [after[i]["content"] for i in starts]
    # what the model read after each turn
    read = [[m["content"] for m in after[i + 1:j]] for i, j in zip(starts, starts[1:] + [len(after)])]
    for turn, content in enumerate(turns):
        if keep_turns is not None and turn < len(traj.step_prompts):
            seen = list(range(max(0, turn - keep_turns) + 1, turn + 1))  # the earlier turns it saw, 1-based
            saw = "the prompt" + (f" and turn {seen[0]}" if len(seen) == 1
                                  else f" and turns {seen[0]}-{seen[-1]}" if seen else "")
            dropped = turn - len(seen)
            left_out = f", {dropped} earlier turn{'s' if dropped > 1 else ''} left out" if dropped else ""
            console.print(Text(f"(step {turn + 1} saw {saw}{left_out}: "
                               f"{len(traj.step_prompts[turn])} tokens)", style="dim"))
        calls = [c for c in traj.tool_calls if c.turn == turn]
        answer = extract_answer(content)
        blocks = CALL_BLOCK_RE.findall(content)
        prose = THINK_TAG_RE.sub("", ANSWER_RE.sub("", CALL_BLOCK_RE.sub("", content))).strip()
        if prose and (calls or answer is not None):
            console.print(Panel(Text(printable(prose)), title="reasoning", title_align="left",
                                border_style="dim"))
        elif prose:  # no call and no <answer> tag: the whole reply is what the agent said
            console.print(Panel(Text(printable(prose)), title="reply", title_align="left",
                                border_style="magenta"))
        for i, call in enumerate(calls):
            if call.name is not None:
                said = f"{call.name}({json.dumps(call.arguments, ensure_ascii=False)})"
            else:
                # unparsable: what the model wrote (parse_tool_calls makes one call per block, in order)
                said = blocks[i] if i < len(blocks) else "(malformed tool call)"
            console.print(Panel(Text(printable(said)), title="tool call", title_align="left",
                                border_style="yellow"))
            # the last turn's calls: the model never read their results
            if i >= len(read[turn]):
                continue
            # the name is the model's
            title = f"{call.name or 'tool'} error" if call.error else f"{call.name} result"
            console.print(Panel(Text(printable(read[turn][i])), title=Text(printable(title)),
                                title_align="left", border_style="red" if call.error else "blue"))
        if answer is not None:
            console.print(Panel(Text(printable(answer), style="bold"), title="answer", title_align="left",
                                border_style="green"))
    if traj.finish_reason in STOPPED:
        console.print(Text(f"(stopped: {STOPPED[traj.finish_reason]}"
                           + (f": {printable(traj.error)})" if traj.error else ")"), style="dim"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, epilog=reference(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="exported checkpoint folder (<run_dir>/hf), hub id, or 'tiny'")
    parser.add_argument("--question", default=None, help="answer this one question and exit")
    parser.add_argument("--config", default=None,
                        help="preset for tools and budgets "
                             "(default: the run's config.json, else the defaults)")
    parser.add_argument("--tools", default=None,
                        help="comma-separated built-in tools: search, calculator, or empty for none "
                             "(default: the task's)")
    parser.add_argument("--index", default=None,
                        help="search: index folder from build_index.py (default: the task's task.index_dir)")
    parser.add_argument("--system", default=None, help="system prompt (default: the task's)")
    parser.add_argument("--engine", choices=["auto", "vllm", "hf"], default=None,
                        help="generation engine (default: rollout.engine)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. rollout.max_turns=6")
    args = parser.parse_args(argv)
    if args.temperature < 0:
        parser.error("--temperature must be >= 0")
    # the model would answer nothing with whatever it makes up
    if args.question is not None and not args.question.strip():
        fail("--question is empty; ask a question, or leave --question out to chat")
    try:
        cfg, config_source = load_run_config(args.model, args.config, args.overrides)
    except ConfigError as e:
        fail(f"config: {e}")
    if args.index and hasattr(cfg.task, "index_dir"):  # the task's own search, too
        cfg.task.index_dir = args.index
    try:
        task = load_task(cfg.data.task)
    except (OSError, ValueError) as e:
        fail(str(e))

    import torch
    from rich.console import Console
    from rich.text import Text
    from transformers import AutoConfig, AutoTokenizer

    from nanoagent.engine import SamplingConfig, make_engine
    from nanoagent.hub import resolve_model

    model_path = resolve_model(args.model, "chat.py")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        max_positions = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    except Exception as e:  # an unknown hub id, a broken folder: transformers says what is wrong
        fail(f"--model {args.model!r} does not load: {str(e).strip().splitlines()[0]}")
    try:
        tools = None if args.tools is None else named_tools(
            [t.strip() for t in args.tools.split(",") if t.strip()], cfg, args.index)
        env = task_env(task, cfg, tokenizer, tools)
    # no index there, an unknown tool, an index that will not load, a template a rollout would fail on
    # (ChatEnv.check)
    except (OSError, ValueError) as e:
        fail(str(e))
    max_context = min(cfg.rollout.max_context_tokens, max_positions or cfg.rollout.max_context_tokens)
    # bfloat16 on a CPU: slow, or not there
    dtype = cfg.rollout.dtype if torch.cuda.is_available() else "float32"
    console = Console()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout, which is the chat's
    try:
        with console.status(f"loading {args.model}"):
            engine = make_engine(args.engine or cfg.rollout.engine, model_path, tokenizer, max_context, dtype,
                                 cfg.rollout.gpu_memory_utilization, cfg.rollout.tensor_parallel_size,
                                 cfg.seed, cfg.rollout.compile)
    # no vLLM, weights missing, a stop tag the tokenizer splits
    except (OSError, RuntimeError, ValueError) as e:
        fail(f"cannot start the engine for {args.model!r}: {str(e).strip().splitlines()[0]}")
    sampling = SamplingConfig(cfg.rollout.max_new_tokens, args.temperature or 1.0, cfg.rollout.top_p,
                              greedy=args.temperature == 0)
    system = task.SYSTEM_PROMPT if args.system is None else args.system
    wording = task.QUESTION
    messages = [{"role": "system", "content": system}] if system else []

    def answer(question):
        nonlocal messages
        with console.status("thinking"):
            traj = ask(engine, env, messages, wording.format(question), sampling, cfg.rollout.max_turns,
                       max_context)
        if len(traj.sample["messages"]) <= len(messages):  # ask started over
            console.print(Text("(the conversation outgrew the context budget: "
                               "it starts over from this question)", style="dim"))
        show(console, traj, cfg.rollout.keep_turns if cfg.rollout.context == "last_k" else None)
        messages = traj.messages

    if args.question is not None:
        try:
            answer(args.question)
        except ValueError as e:
            fail(str(e))
        return 0
    # Ctrl-C leaves, even when whatever started chat.py ignores SIGINT (a shell's background job, CI):
    # Python then keeps it ignored and never raises KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    console.print(Text.assemble(("nanoagent chat", "bold"),
                                f" with {args.model}\ntools: "
                                f"{', '.join(s['function']['name'] for s in env.schemas) or 'none'}, "
                                f"config: {config_source}; Ctrl-D or Ctrl-C leaves"), style="dim")
    while True:
        question = console.input("[bold cyan]you>[/bold cyan] ").strip()
        if question:
            try:
                answer(question)
            except ValueError as e:
                console.print(Text(str(e), style="red"))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (EOFError, KeyboardInterrupt):  # Ctrl-D at the prompt, Ctrl-C anywhere: leave quietly
        print()
        sys.exit(0)
