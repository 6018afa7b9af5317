"""Prompts for the load test: a parquet or JSONL file with a prompt column (default: the built-in task's traffic
split, which no training, validation or test split shares).

A prompt cell is either text or a chat (a list of ``{"role", "content"}`` messages, as in verl's parquet files).
Chat users send the messages; text users (``/generate``, ``/v1/completions``) need text, so a chat is rendered
with the served model's own chat template through the server's ``/tokenize`` + ``/detokenize`` (vLLM's server has
the same pair), falling back to the messages' joined contents when the server cannot do that.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from verl.data.sources import resolve_data_file
from verl.errors import DataError

# The built-in task's traffic split: prompts no training, validation or test split holds, so records of a load test
# can become training data (verl data from-records) without training on a yardstick.
DEFAULT_PROMPT_FILE = "builtin:arithmetic/traffic"


@dataclass(frozen=True)
class Prompt:
    """One prompt in both forms the endpoints need."""

    messages: tuple[dict[str, str], ...]  # for /v1/chat/completions
    text: str  # for /generate and /v1/completions
    chat: bool  # the file gave a chat (text endpoints want it rendered with the chat template)
    ground_truth: str | None = None  # verl data files' reward_model.ground_truth (RouteUser --reward sends it)


def _as_messages(cell: Any, where: str) -> tuple[dict[str, str], ...]:
    if isinstance(cell, str):
        if not cell.strip():
            raise DataError(f"{where}: the prompt is empty")
        return ({"role": "user", "content": cell},)
    if isinstance(cell, (list, tuple)) and cell:
        messages = []
        for message in cell:
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise DataError(f"{where}: a chat prompt must be a list of {{'role': str, 'content': str}} "
                                f"messages; got an item {message!r}")
            messages.append({"role": message["role"], "content": message["content"]})
        return tuple(messages)
    raise DataError(f"{where}: the prompt must be text or a non-empty list of chat messages; got {cell!r}")


def _read_cells(path: Path, column: str) -> tuple[list[Any], list[str | None] | None]:
    """The prompt column's cells and, when the file has verl's ``reward_model`` column, each row's ground truth."""
    if not path.is_file():
        raise DataError(f"prompt file '{path}' does not exist (give a .parquet or .jsonl file with a "
                        f"'{column}' column, or builtin:arithmetic/traffic)")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        table = pq.read_table(path)
        if column not in table.column_names:
            raise DataError(f"prompt file '{path}' has no column '{column}' (columns: "
                            f"{', '.join(table.column_names)}); choose one with --prompt-column")
        rewards = table.column("reward_model").to_pylist() if "reward_model" in table.column_names else []
        return table.column(column).to_pylist(), _ground_truths(rewards)
    if suffix in (".jsonl", ".json"):
        cells, rewards = [], []
        try:
            raw_lines = path.read_bytes().decode("utf-8").splitlines()
        except UnicodeDecodeError as exc:
            bad_line = exc.object[:exc.start].count(b"\n") + 1
            raise DataError(f"{path}, line {bad_line}: not UTF-8 text (byte {exc.object[exc.start:exc.start + 1]!r}); "
                            "save the prompt file as UTF-8") from None
        for number, line in enumerate(raw_lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}, line {number}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict) or column not in row:
                raise DataError(f"{path}, line {number}: no '{column}' field; choose one with --prompt-column")
            cells.append(row[column])
            rewards.append(row.get("reward_model"))
        return cells, _ground_truths(rewards)
    raise DataError(f"prompt file '{path}' must end in .parquet or .jsonl")


def _ground_truths(rewards: list[Any]) -> list[str | None] | None:
    """Each row's ``reward_model.ground_truth`` (verl's data format), or None when no row has one."""
    truths = [c.get("ground_truth") if isinstance(c, dict) else None for c in rewards]
    return [None if t is None else str(t) for t in truths] if any(t is not None for t in truths) else None


def load_prompts(name: str = DEFAULT_PROMPT_FILE, column: str = "prompt", limit: int | None = None) -> list[Prompt]:
    """Read prompts from ``name`` (a path or ``builtin:TASK/SPLIT``); text forms start as the joined contents."""
    path = resolve_data_file(name)
    cells, truths = _read_cells(path, column)
    truths = truths or [None] * len(cells)
    if limit is not None:
        cells = cells[:limit]
    if not cells:
        raise DataError(f"prompt file '{path}' has no prompts")
    prompts = []
    for row, cell in enumerate(cells):
        messages = _as_messages(cell, f"{path}, row {row}, column '{column}'")
        prompts.append(Prompt(messages, "\n".join(m["content"] for m in messages), chat=not isinstance(cell, str),
                              ground_truth=truths[row]))
    return prompts


def _post_json(url: str, body: dict, headers: dict[str, str], timeout: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (the test's own target host)
        return json.loads(response.read())


def render_with_server(prompts: list[Prompt], host: str, headers: dict[str, str] | None = None,
                       timeout: float = 10.0) -> tuple[list[Prompt], str | None]:
    """Text forms rendered by the server's chat template; on any failure the prompts come back unchanged.

    Returns ``(prompts, problem)``; ``problem`` says why rendering was skipped (``None`` when it worked).
    Only chats need it: a plain-text prompt file is sent as written.
    """
    headers = headers or {}
    base = host.rstrip("/")
    rendered = []
    try:
        for prompt in prompts:
            if not prompt.chat:
                rendered.append(prompt)
                continue
            tokens = _post_json(f"{base}/tokenize", {"messages": list(prompt.messages),
                                                     "add_generation_prompt": True}, headers, timeout)["tokens"]
            text = _post_json(f"{base}/detokenize", {"tokens": tokens}, headers, timeout)["prompt"]
            rendered.append(Prompt(prompt.messages, text, chat=True, ground_truth=prompt.ground_truth))
    except (OSError, urllib.error.URLError, KeyError, TypeError, ValueError) as exc:
        return prompts, f"{type(exc).__name__}: {exc}"
    return rendered, None
