"""
An agent written with the openai package, trained unchanged through nanoagent's OpenAI-compatible
endpoint (nanoagent/endpoint.py): docs/extending.md's example of training an agent you already
have. It answers the arithmetic task's questions with a calculator it runs itself; the prompts, the
demonstrations for a warm start and the held-out split are the arithmetic task's.

    python train.py --config=tiny data.task=openai_agent train.warm_start_steps=40
"""

import json
import re

from openai import OpenAI

from nanoagent.tasks import arithmetic
from nanoagent.tools import calculate  # the agent's own tool (nanoagent's safe calculator), run by the agent

SYSTEM_PROMPT, QUESTION = arithmetic.SYSTEM_PROMPT, arithmetic.QUESTION
prompts, demonstration, prepare = arithmetic.prompts, arithmetic.demonstration, arithmetic.prepare
Knobs = arithmetic.Knobs


# -----------------------------------------------------------------------------
# the agent, as it would be written for any OpenAI-compatible server

# one client for every trajectory, each its own base URL: OpenAI() costs ~20 ms of CPU (its SSL context),
# with_options() 0.3 ms
CLIENT = OpenAI(base_url="http://unused", api_key="unused")
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression, e.g. 12 * 7.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


def agent(base_url, row):
    client = CLIENT.with_options(base_url=base_url)
    model = client.models.list().data[0].id
    messages = list(row["messages"])
    for _ in range(3):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            try:
                result = calculate(json.loads(call.function.arguments)["expression"])
            except Exception as e:
                result = f"Error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = re.search(r"<answer>(.*?)</answer>", reply.content or "")
    return float(answer is not None and answer.group(1).strip() == row["answers"][0])
