"""chat.py end to end: a tiny model that memorised a calculator conversation answers through a real
tool call, once (--question) and interactively through a pseudo-terminal; bad input is refused
with a clear message."""

import json
import os
import pty
import select
import shutil
import subprocess
import sys
import time

import pytest
from transformers import AutoTokenizer

import scripted
from nanoagent.tools import ToolEnv, calculator_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM = scripted.user("")[0]["content"]
CHAT = [sys.executable, os.path.join(ROOT, "chat.py")]


@pytest.fixture(scope="module")
def chat_model(tiny_model_dir, tmp_path_factory):
    env = ToolEnv([calculator_tool()], AutoTokenizer.from_pretrained(tiny_model_dir))
    path, loss = scripted.memorise(tiny_model_dir, str(tmp_path_factory.mktemp("chat_model")), env, steps=150)
    assert loss < 0.05, f"the tiny model did not memorise the scripts (loss {loss:.3f})"
    return path


@pytest.mark.slow
def test_question_answers_once_through_a_tool_call(chat_model):
    proc = subprocess.run(CHAT + ["--model", chat_model, "--tools", "calculator", "--system", SYSTEM, "--engine", "vllm",
                                 "--question", "Compute 12*7."], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "tool call" in out and 'calculator({"expression": "12*7"})' in out
    assert "calculator result" in out and "answer" in out
    assert out.index("calculator result") < out.rindex("84")  # the result, then the answer that copies it


@pytest.mark.slow
def test_interactive_chat_in_a_terminal(chat_model):
    pid, fd = pty.fork()
    if pid == 0:  # the child: chat.py on the pseudo-terminal
        os.chdir(ROOT)
        os.execv(sys.executable, CHAT + ["--model", chat_model, "--tools", "calculator", "--system", SYSTEM, "--engine", "hf"])

    def read_until(text, timeout):
        seen, end = b"", time.time() + timeout
        while text.encode() not in seen and time.time() < end:
            if select.select([fd], [], [], 1)[0]:
                try:
                    seen += os.read(fd, 65536)
                except OSError:
                    break
        return seen.decode(errors="replace")

    assert "you>" in read_until("you>", 240)
    os.write(fd, b"Compute 12*7.\n")
    out = read_until("you>", 240)
    assert "calculator result" in out and "84" in out, out[-2000:]
    os.write(fd, b"\x04")  # Ctrl-D: end of input
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def run_chat(*args):
    return subprocess.run(CHAT + list(args), capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_bad_model_path_and_missing_index_are_refused(tmp_path):
    proc = run_chat("--model", str(tmp_path / "nope"), "--question", "hi")
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_chat("--model", str(tmp_path), "--index", str(tmp_path / "no_index"), "--question", "hi")
    assert proc.returncode == 2 and "not a search index" in proc.stderr and "Traceback" not in proc.stderr


def test_model_without_chat_template_is_refused(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(model)
    for name in os.listdir(model):
        if name.endswith(".jinja"):
            os.remove(model / name)
    config = model / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data.pop("chat_template", None)
    config.write_text(json.dumps(data))
    proc = run_chat("--model", str(model), "--tools", "calculator", "--question", "hi")
    assert proc.returncode == 2 and "no chat template" in proc.stderr and "Traceback" not in proc.stderr
