"""
chat.py: a tiny model that memorised scripted.py's calculator conversation answers through a real
tool call, once (--question, on the vLLM CPU engine) and interactively in a pseudo-terminal (the
fallback engine); the conversation carries over from question to question; the panels show every
part of a turn; bad input is refused with one clear line and a non-zero status.
"""

import os
import pty
import select
import shutil
import signal
import sys
import time
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from io import StringIO

import pytest
from rich.console import Console
from transformers import AutoTokenizer

import procs
import scripted
from nanoagent.agent import Trajectory
from nanoagent.engine import HFEngine, SamplingConfig, stop_token_ids
from nanoagent.env import tool_env
from nanoagent.tools import calculator_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import chat  # noqa: E402

CHAT = [sys.executable, os.path.join(ROOT, "chat.py")]
QUESTION = "Compute 12*7."
SYSTEM = scripted.user(QUESTION)[0]["content"]
GREEDY = SamplingConfig(max_new_tokens=48, greedy=True)


@pytest.fixture(scope="module")
def env(tiny_model_dir):
    return tool_env([calculator_tool()], AutoTokenizer.from_pretrained(tiny_model_dir))


@pytest.fixture(scope="module")
def chat_model(tiny_model_dir, env, tmp_path_factory):
    """The tiny model after memorising the one calculator conversation (a few seconds)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scripted, "SCRIPTS", {QUESTION: scripted.SCRIPTS[QUESTION]})
        path, loss = scripted.memorise(tiny_model_dir, str(tmp_path_factory.mktemp("chat_model")), env, steps=60)
    assert loss < 0.05, f"the tiny model did not memorise the conversation (loss {loss:.3f})"
    return path


def test_conversation_carries_over_and_starts_over_when_full(chat_model, env):
    engine = HFEngine(chat_model, stop_token_ids(env.tokenizer), env.tokenizer.pad_token_id, "float32")
    system = [{"role": "system", "content": SYSTEM}]
    first = chat.ask(engine, env, system, QUESTION, GREEDY, 4, 2048)
    assert [(c.name, c.result) for c in first.tool_calls] == [("calculator", "84")] and first.final_text == "<answer>84</answer>"
    second = chat.ask(engine, env, first.messages, "And again?", GREEDY, 4, 2048)
    assert second.sample["messages"] == first.messages + [{"role": "user", "content": "And again?"}]
    assert second.prompt_ids[:len(first)] == first.prompt_ids + first.response_ids  # the first exchange, token for token
    # a conversation over the context budget starts over from the system prompt with the new question
    continued = len(env.prompt_ids(first.messages + [{"role": "user", "content": QUESTION}]))
    third = chat.ask(engine, env, first.messages, QUESTION, GREEDY, 4, continued)
    assert third.sample["messages"] == system + [{"role": "user", "content": QUESTION}] and third.final_text == "<answer>84</answer>"
    with pytest.raises(ValueError, match="over the context budget"):
        chat.ask(engine, env, system, QUESTION, GREEDY, 4, 16)


def panel_trajectory(env, turns, finish_reason):
    """A trajectory of the given assistant turns, stepped through the environment (their tool calls
    run for real), as run_agent makes one: the model reads the results of every turn but the last."""
    asked = scripted.user(QUESTION)
    environment = env.make()
    t = Trajectory(sample={"messages": asked}, prompt_ids=[], messages=list(asked), finish_reason=finish_reason)
    for turn, content in enumerate(turns):
        observation, _, _, info = environment.step(content)
        t.tool_calls += info["tool_calls"]
        t.messages.append({"role": "assistant", "content": content})
        if turn < len(turns) - 1:
            t.messages += [{**m, "content": env.truncate(m["content"], m["role"])} for m in observation]
    return t


def tool_message(traj, k):
    """The k-th tool message of a trajectory: a result as the model read it."""
    return [m for m in traj.messages if m["role"] == "tool"][k]


def render(traj):
    console = Console(file=StringIO(), width=100, color_system=None)
    chat.show(console, traj)
    return console.file.getvalue()


def test_panels_show_reasoning_calls_results_errors_and_answer(env):
    def trajectory(turns, finish_reason):
        return panel_trajectory(env, turns, finish_reason)

    out = render(trajectory(["<think>Multiply with the tool.</think>\n" + scripted.call("calculator", {"expression": "12*7"}) +
                             scripted.call(None, None, raw="{oops}"), "<answer>84</answer>"], "done"))
    order = ["reasoning", "Multiply with the tool.", "tool call", 'calculator({"expression": "12*7"})', "calculator result", "84",
             "tool call", "{oops}", "tool error", "invalid JSON", "answer", "84"]
    at = 0
    for text in order:
        at = out.index(text, at)  # there, and in this order
    assert "<think>" not in out and "stopped" not in out
    out = render(trajectory(["No tags, and the turn ran out of tok"], "truncated"))
    assert "reply" in out and "No tags, and the turn ran out of tok" in out and "(stopped: the turn ran out of new tokens" in out
    out = render(trajectory([scripted.call("calculator", {"expression": "1+1"})] * 2, "max_turns"))
    assert out.count("tool call") == 2 and out.count("calculator result") == 1 and "(stopped: the agent used all its turns" in out


def test_panels_say_what_each_step_saw_with_a_context_per_step(env):
    t = panel_trajectory(env, [scripted.call("calculator", {"expression": "1+1"})] * 3 + ["<answer>2</answer>"], "done")
    t.step_prompts = [[0] * n for n in (40, 60, 61, 61)]
    console = Console(file=StringIO(), width=100, color_system=None)
    chat.show(console, t, keep_turns=1)
    out = console.file.getvalue()
    lines = ["(step 1 saw the prompt: 40 tokens)", "(step 2 saw the prompt and turn 1: 60 tokens)",
             "(step 3 saw the prompt and turn 2, 1 earlier turn left out: 61 tokens)",
             "(step 4 saw the prompt and turn 3, 2 earlier turns left out: 61 tokens)"]
    at = [out.index(line) for line in lines]
    assert at == sorted(at) and out.index("tool call") > at[0] and out.index("answer") > at[-1]
    assert "saw" not in render(t)  # the full context: nothing to say


def test_panels_escape_control_characters_and_show_markup_as_text(env):
    """What the model or a tool writes cannot move the cursor, recolour or retitle the terminal (its
    control characters are shown escaped), nor style the panels (rich markup in it is shown as written)."""
    evil = "\x1b[31mred\x1b[0m \x1b]0;title\x07 \r\x08\x9b2J\x00 [bold red]loud[/bold red]\ttab"
    t = panel_trajectory(env, [f"<think>{evil}</think>" + scripted.call("calculator", {"expression": "1+1"}) +
                               scripted.call(f"[red]x[/red]{evil}", {}), f"<answer>{evil}</answer>"], "done")
    tool_message(t, 0)["content"] = evil  # a tool's own output
    out = render(t)
    assert not set(out) & {chr(c) for c in [*range(0x00, 0x09), *range(0x0b, 0x20), *range(0x7f, 0xa0)]}, repr(out)
    shown = r"\x1b[31mred\x1b[0m \x1b]0;title\x07 \x0d\x08\x9b2J\x00 [bold red]loud[/bold red]"
    assert out.count(shown) == 5  # the reasoning, the calculator's result, the unknown tool's call and its error's title, the answer
    assert "\n╭─ [red]x[/red]" + r"\x1b[31mred" in out  # that title, the model's tool name as written


# Unicode's Bidi_Control characters: each reorders the text shown after it (U+202E shows "abc" as "cba")
BIDI_CONTROLS = [unicodedata.lookup(name) for name in [
    "ARABIC LETTER MARK", "LEFT-TO-RIGHT MARK", "RIGHT-TO-LEFT MARK", "LEFT-TO-RIGHT EMBEDDING", "RIGHT-TO-LEFT EMBEDDING",
    "POP DIRECTIONAL FORMATTING", "LEFT-TO-RIGHT OVERRIDE", "RIGHT-TO-LEFT OVERRIDE", "LEFT-TO-RIGHT ISOLATE",
    "RIGHT-TO-LEFT ISOLATE", "FIRST STRONG ISOLATE", "POP DIRECTIONAL ISOLATE"]]


def test_panels_escape_bidi_controls(env):
    """A bidi override in the model's or a tool's text would make the panels read as something they
    do not say (a result "48" shown as "84"): every bidi control is shown escaped, as \\u202e."""
    explicit = {chr(c) for c in range(0x10000) if unicodedata.bidirectional(chr(c)) in {"LRE", "RLE", "LRO", "RLO", "PDF", "LRI", "RLI", "FSI", "PDI"}}
    assert explicit < set(BIDI_CONTROLS)  # the list holds every embedding, override and isolate there is
    evil = "".join(f"{c}{i}" for i, c in enumerate(BIDI_CONTROLS))
    t = panel_trajectory(env, [f"<think>{evil}</think>" + scripted.call("calculator", {"expression": "1+1"}), f"<answer>{evil}</answer>"], "done")
    tool_message(t, 0)["content"] = evil
    out = render(t)
    assert not set(out) & set(BIDI_CONTROLS), repr(out)
    shown = "".join(f"\\u{ord(c):04x}{i}" for i, c in enumerate(BIDI_CONTROLS))
    assert out.count(shown) == 3, out  # the reasoning, the calculator's result, the answer


@pytest.mark.slow
def test_question_answers_once_through_a_tool_call(chat_model):
    common = ["--model", chat_model, "--system", SYSTEM, "--question", QUESTION]
    # beside it, with a context per step, each step says what it saw (the fallback engine: no second vLLM start)
    commands = [[*common, "--engine", "vllm", "data.task=arithmetic"],
                [*common, "--engine", "hf", "data.task=arithmetic", "rollout.context=last_k", "rollout.keep_turns=1"]]
    with ThreadPoolExecutor(max_workers=2) as pool:
        proc, proc_last_k = pool.map(lambda args: procs.run(CHAT + args, capture_output=True, text=True, timeout=300, cwd=ROOT), commands)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout  # a pipe: plain text, no colour codes, nothing but the panels
    assert "\x1b[" not in out and out.lstrip().startswith("╭─ tool call")
    at = [out.index('calculator({"expression": "12*7"})'), out.index("calculator result"), out.index("answer")]
    assert at == sorted(at) and "84" in out[at[1]:at[2]] and "84" in out[at[2]:]
    assert proc_last_k.returncode == 0, proc_last_k.stderr[-3000:]
    out = proc_last_k.stdout
    assert out.index("(step 1 saw the prompt: ") < out.index("tool call") < out.index("(step 2 saw the prompt and turn 1: ") < out.index("answer")


def spawn_chat(*args):
    """chat.py in a pseudo-terminal, as a person would run it; returns (pid, terminal fd). It starts
    with SIGINT ignored, as under CI or from a script's background job (Python then never raises
    KeyboardInterrupt unless chat.py asks for it), so Ctrl-C is tested in the harder case wherever
    the tests run."""
    pid, fd = pty.fork()
    if pid == 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.chdir(ROOT)
        os.execv(sys.executable, CHAT + list(args))
    return pid, fd


def read_until(fd, text, timeout=240):
    seen, end = b"", time.time() + timeout
    while text.encode() not in seen and time.time() < end:
        if select.select([fd], [], [], 1)[0]:
            try:
                seen += os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
    return seen.decode(errors="replace")


def exit_status(pid, last_words, timeout=60):
    """chat.py's exit code; if it does not exit in time, what it printed last, where each of its
    threads waits and its signal masks."""
    end = time.time() + timeout
    while time.time() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    signals = [line for line in open(f"/proc/{pid}/status") if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn"))]
    threads = [open(f"/proc/{pid}/task/{t}/wchan").read() for t in sorted(os.listdir(f"/proc/{pid}/task"))]
    stack = procs.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 12"], capture_output=True, text=True, timeout=120).stdout \
        if shutil.which("gdb") else ""
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"chat.py did not exit within {timeout}s; last printed {last_words[-1500:]!r}; threads wait in {threads}; {signals}\n{stack[-6000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("leave", [b"\x04", b"\x03"], ids=["ctrl-d", "ctrl-c"])
def test_interactive_chat_in_a_terminal(chat_model, leave):
    pid, fd = spawn_chat("--model", chat_model, "--system", SYSTEM, "--engine", "hf", "data.task=arithmetic")
    try:
        assert "you>" in read_until(fd, "you>")
        os.write(fd, QUESTION.encode() + b"\n")
        out = read_until(fd, "you>")
        assert 'calculator({"expression": "12*7"})' in out and "calculator result" in out and "answer" in out, out[-3000:]
        # as a person would, not within a millisecond of the prompt: a SIGINT that lands after input() has
        # printed the prompt but before it blocks in read() is only seen at the next line (CPython's input)
        time.sleep(0.5)
        os.write(fd, leave)
        last_words = read_until(fd, "\0", timeout=30)  # drain the terminal until chat.py closes it
        assert exit_status(pid, last_words) == 0
    finally:
        os.close(fd)


def run_chat(*args):
    return procs.run(CHAT + list(args), capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_an_empty_question_is_refused_before_the_model_loads(tmp_path):
    for question in ["", "  \t\n "]:
        proc = run_chat("--model", str(tmp_path / "nope"), "--question", question)  # refused before the model is even looked for
        assert proc.returncode == 2 and "--question is empty" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""


def test_bad_model_paths_are_refused(tmp_path):
    for model, message in [(tmp_path / "nope", "does not exist"), (tmp_path, "a folder without a model")]:
        proc = run_chat("--model", str(model), "--question", "hi")
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""


def main_fails(argv, capsys):
    """chat.main's exit status and its one line on stderr."""
    with pytest.raises(SystemExit) as exit:
        chat.main(argv)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return exit.value.code, err


def test_missing_index_is_refused(tiny_model_dir, tmp_path, capsys):
    status, err = main_fails(["--model", tiny_model_dir, "--tools", "search", "--index", str(tmp_path / "no_index"), "--question", "hi"], capsys)
    assert status == 2 and "no search index at" in err and "build_index.py" in err
    # the default tools come from the config: a search task (the defaults) needs its task.index_dir
    no_index = f"task.index_dir={tmp_path / 'no_index'}"
    status, err = main_fails(["--model", tiny_model_dir, no_index, "--question", "hi"], capsys)
    assert status == 2 and "no search index at" in err


def test_model_without_chat_template_is_refused(tiny_model_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = None
    for name in os.listdir(model):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            os.remove(model / name)
    tokenizer.save_pretrained(model)
    status, err = main_fails(["--model", str(model), "--question", "hi", "data.task=arithmetic"], capsys)
    assert status == 2 and "no chat template" in err
