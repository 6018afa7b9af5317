"""The official ``openai`` client's tool loop against the verl service: the model calls the calculator, this
script runs it (the service never runs tools), sends the result back, and the model answers.

    VERL_SERVE_MODEL=exports/agent-a uvicorn serve.api:app --host 127.0.0.1 --port 8000
    python examples/agent_client.py "What is 37*412?"
"""

from __future__ import annotations

import argparse
import json

from openai import OpenAI

from verl.tools.calculator import SCHEMA, calculator  # the same calculator the model trained with

TOOLS = {"calculator": calculator}


def ask(client: OpenAI, model: str, question: str, max_turns: int = 4) -> str:
    """Chat until the model answers without a tool call; print every turn."""
    messages: list[dict] = [{"role": "user", "content": question}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, tools=[SCHEMA], temperature=0,
                                               max_tokens=96)
        message = reply.choices[0].message
        if not message.tool_calls:
            print(f"assistant: {message.content}")
            return message.content or ""
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            result = TOOLS[call.function.name](**arguments)
            print(f"assistant calls {call.function.name}({arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question", nargs="?", default="What is 37*412?")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused")
    ask(client, client.models.list().data[0].id, args.question)


if __name__ == "__main__":
    main()
