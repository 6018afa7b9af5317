"""An agent written against the official ``openai`` client, trained as it is by ``verl train``:

    verl train --config configs/agent_tiny.yaml rollout.multi_turn.enable=false \\
        rollout.gateway.agent=examples/openai_agent.py:solve

The trainer serves its current policy and calls ``solve(client, row)`` ``rollout.n`` times per prompt; ``client`` is
an ``openai.OpenAI`` bound to the served policy and to the episode, ``row`` the dataset row (``messages``,
``ground_truth``, ``model``, the trainer's ``sampling`` and a ``seed``). The agent keeps its own history, runs its
own tools and returns a reward, or None to let the run's reward score what the model wrote (docs/agents.md).
"""

from __future__ import annotations

import json

from verl.tools.calculator import SCHEMA, CalculatorError, calculator  # the calculator the tiny agent learnt with


def solve(client, row: dict, max_turns: int = 3, summarise_after: int | None = None) -> float | None:
    """A plain tool loop: ask, run the calls the model makes, send the results back, until it answers. With
    ``summarise_after=K``, after K assistant turns (and their tool replies) the history is replaced by the question
    and a note of the tool results so far (an agent that keeps its context short): the calls after it start a new
    training sample."""
    messages = list(row["messages"])
    sampling = row["sampling"]
    results: list[str] = []
    for turn in range(max_turns):
        if summarise_after is not None and turn == summarise_after:
            messages = [*row["messages"], {"role": "user", "content": "Tool results so far: " + "; ".join(results)}]
        reply = client.chat.completions.create(model=row["model"], messages=messages, tools=[SCHEMA],
                                               temperature=sampling["temperature"], top_p=sampling["top_p"],
                                               max_tokens=sampling["max_tokens"], seed=row["seed"])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"}))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except (CalculatorError, TypeError, ValueError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            results.append(f"{call.function.arguments} = {result}")
    return None  # the data source's rule (the answer after ">>") scores the episode


def solve_summarising(client, row: dict) -> float | None:
    """``solve`` that summarises its history after two assistant turns (issue 64's agent we did not write for our
    loop): a third call is asked on the question and a note of the tool results, a fresh history."""
    return solve(client, row, summarise_after=2)
