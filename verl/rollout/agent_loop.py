"""Multi-turn rollouts with tools, behind the rollout interface (``rollout.multi_turn.enable``; docs/agents.md).

A trajectory alternates model turns and tool turns until the model answers without calling a tool, reaches
``max_assistant_turns``, or fills the response budget (``data.max_response_length`` tokens in all)::

    prompt -> generate until eos -> parse <tool_call> blocks -> run the tools -> the template's ids for the
    tool turn -> generate until eos -> ... -> final answer

**Token-in, token-out.** The trajectory's ids are the ids the model generated, then the ids the chat template adds
for each tool turn (``ConversationTokens.turn_ids``), never a re-tokenization of decoded text. The loss mask
(``response_mask``) is 1 on generated ids (eos included) and 0 on the tool turns; ``attention_mask`` covers both.
The trainer's policy loss, KL and entropy read the mask, so tool output is context, not action; the reward scores
the whole trajectory's text.

**No batch-wide stall.** The transformers path decodes with continuous batching over a slot cache (``SlotCache``:
each trajectory keeps one row of the KV store from its prefill to its end): a trajectory that calls a tool leaves
the step while its tools run on the ``ToolRunner``; the others keep decoding; its cache stays in its slot, and when
its results arrive one forward over the ids it has not fed yet (the turn's eos and the tool turn) appends them in
place, and it decodes again (what vLLM's prefix cache does for a re-sent conversation). Sampling draws from one
generator per trajectory, seeded from the call seed, the prompt id and the sample number, so a rollout
does not depend on tool timing or on which trajectories share a step.

Outputs (one row per trajectory, ``prompts x n``, a prompt's samples adjacent), beside the usual tensors
(``assemble_trajectories``): ``num_turns``, ``num_tool_calls``, ``num_valid_calls``, ``num_tool_errors``,
``finish_reason`` (``stop``, ``length``, ``turns``) and ``tool_trace`` (each call: turn, name, arguments, result,
error) as non-tensor fields, which the trainer turns into ``rollout/tool_call_rate``, ``valid_call_rate``,
``tool_error_rate`` and which ``verl eval`` reports per trajectory.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from verl.config import MultiTurnConfig
from verl.envs.base import EpisodeError, Observation
from verl.envs.runner import EpisodeRunner
from verl.models.attention import NAME as CPU_ATTENTION
from verl.models.fused_decoder import fused_decoder_layers
from verl.models.packed_linear import packed_weights
from verl.models.precision import at_least_float32, autocast_context
from verl.models.slot_cache import SlotCache
from verl.protocol import DataProto, pad_tokens
from verl.rollout.base import RolloutEngine, SamplingParams
from verl.rollout.sampler import draw_categorical, logits_warpers
from verl.tools.calls import ToolCall, parse_tool_calls
from verl.tools.registry import ToolSet
from verl.tools.runner import ToolResult, ToolRunner, failed
from verl.tools.templates import ConversationTokens, ToolPrompting


@dataclass(eq=False)
class Trajectory:
    """One rollout row in progress: the prompt's ids, then ``ids`` (generated and tool-turn ids) with ``mask``
    (1 = generated) and each generated id's behaviour ``log_probs``."""

    prompt_ids: list[int]
    tools: list[str]
    hidden_kwargs: dict[str, dict[str, Any]]
    generator: torch.Generator | None
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turn_start: int = 0
    turns: int = 0
    calls: int = 0
    valid_calls: int = 0
    tool_errors: int = 0
    trace: list[dict[str, Any]] = field(default_factory=list)
    finish: str | None = None
    waiting: list[tuple[ToolCall, concurrent.futures.Future[ToolResult]]] = field(default_factory=list)
    turn_end: int = 0  # when its last turn ended, in the loop's count (orders tool-result arrivals)
    # Its slot in the agent loop's ``SlotCache`` (None before its prefill and after its end), and how many of its
    # ids the cache holds, so after a tool turn it feeds only the ids after them (no re-prefill).
    cache_slot: int | None = None
    cached: int = 0

    slot: int = 0  # its row in the decode loop's per-trajectory arrays (``DecodeSlots``)
    # With an environment (verl.envs): its episode, the conversation as messages (what the episode reads), the
    # environment's replies so far, each turn's reward at its last generated id, and why the episode failed.
    episode: Any = None
    env_name: str | None = None
    messages: list[dict[str, Any]] | None = None
    user_turns: int = 0
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    env_error: str | None = None
    env_pending: concurrent.futures.Future | None = None
    starting: tuple[Any, dict[str, Any]] | None = None  # (environment, row) until its episode has started
    env_calls: list[ToolCall] | None = None  # a turn's calls its environment runs (an OpenEnv server with tools)
    env_seconds: float = 0.0  # its environment's start and replies, summed (rollout/env/<name>/step_seconds_mean)
    env_steps: int = 0

    def append(self, token: int, generated: bool, log_prob: float = 0.0) -> None:
        self.ids.append(token)
        self.mask.append(int(generated))
        self.log_probs.append(log_prob if generated else 0.0)


def fail(row: Trajectory, exc: BaseException) -> None:
    """End ``row`` as a failed sample: its environment raised, timed out or answered malformed."""
    row.finish = "env_error"
    row.env_error = f"{type(exc).__name__}: {exc}"[:500]


class ToolTurns:
    """What every engine's agent loop shares: the turn logic (parse calls, submit them to the ``ToolRunner``, append
    the tool turn's template ids) around an engine-specific ``run``, which decodes the ready trajectories and calls
    ``_end_turn`` when one ends a turn with eos."""

    gives_log_probs = True  # whether ``run`` records each generated id's behaviour log-prob
    episodes: EpisodeRunner | None = None  # set by AgentRollout when an environment answers turns

    def __init__(self, tokenizer: Any, runner: ToolRunner, tool_set: ToolSet, config: MultiTurnConfig,
                 max_response_length: int, template: str, max_positions: int):
        self.tokenizer, self.runner, self.tool_set = tokenizer, runner, tool_set
        self.config, self.budget, self.template = config, max_response_length, template
        self.eos_id = tokenizer.eos_token_id
        self.max_positions = max_positions
        self._conversations: dict[tuple[str, ...], ConversationTokens] = {}
        # Trajectories whose last tool result has arrived, put by the results' done-callbacks (on the tool
        # threads), so a step looks only at those instead of polling every waiting trajectory's futures.
        self._arrived: queue.SimpleQueue[Trajectory] = queue.SimpleQueue()
        self._turn_ends = itertools.count()  # orders arrivals as the turns ended (what polling the list gave)
        # Episodes' closes in flight (AgentRollout waits for them at the rollout's end), and whether each reads the
        # episode's outcome (an env: class's reward, whatever ended the trajectory).
        self.closing: list[tuple[Trajectory, concurrent.futures.Future, bool]] = []
        self.prompting: ToolPrompting | None = None  # set by AgentRollout: the tool template for env: classes' rows

    def conversation(self, row: Trajectory) -> ConversationTokens:
        """``row``'s conversation: its configured tools, and those its environment brings."""
        brought = getattr(row.episode, "tools", None) or {}
        key = (*row.tools, *(f"env:{name}" for name in brought))
        if key not in self._conversations:
            schemas = self.tool_set.schemas(row.tools) + list(brought.values())
            template = self.prompting.template_for(list(brought.values())) if self.prompting else self.template
            self._conversations[key] = ConversationTokens(self.tokenizer, template, schemas)
        return self._conversations[key]

    def run(self, trajectories: list[Trajectory], params: SamplingParams) -> None:
        """Decode every trajectory to its end (``Trajectory.finish`` set)."""
        raise NotImplementedError

    def _end_turn(self, row: Trajectory, waiting: list[Trajectory]) -> None:
        """The model ended a turn with eos: a final answer, or calls to run (unless no turn or budget is left)."""
        text = self.tokenizer.decode(row.ids[row.turn_start:-1], skip_special_tokens=True)
        row.turns += 1
        turn = parse_tool_calls(text)
        if row.messages is not None:
            row.messages.append({"role": "assistant", "content": text})
        if not turn.has_calls:
            if row.episode is not None and getattr(row.episode, "replies", True) and self._environment_answers(row):
                self._await_environment(row, waiting, row.episode.step, list(row.messages),
                                        what=f"environment '{row.env_name}'")
                return
            row.finish = "stop"
            self._ended(row)
            return
        brought = getattr(row.episode, "tools", None) or {}  # an env: class's methods
        problems = [self.runner.check(call, row.tools, brought) for call in turn.calls]  # None: parses, fits
        row.calls += len(turn.calls)
        row.valid_calls += sum(problem is None for problem in problems)
        # Calls in a turn with nothing after it are counted (the model made them) but not run.
        if row.turns >= self.config.max_assistant_turns or len(row.ids) >= self.budget:
            row.finish = "turns" if row.turns >= self.config.max_assistant_turns else "length"
            row.trace.extend({"turn": row.turns, "name": call.name, "arguments": call.arguments, "result": None,
                              "error": f"not run: the trajectory ended ({row.finish} limit)"} for call in turn.calls)
            self._ended(row)
            return
        if getattr(row.episode, "takes_calls", False):  # the environment runs the calls itself
            row.env_calls = turn.calls
            self._await_environment(row, waiting, row.episode.step, list(row.messages),
                                    what=f"environment '{row.env_name}'")
            return
        for index, call in enumerate(turn.calls):
            if index >= self.config.max_parallel_calls:
                result: concurrent.futures.Future[ToolResult] = concurrent.futures.Future()
                result.set_result(failed(f"at most {self.config.max_parallel_calls} calls per turn"))
            elif call.name in brought and problems[index] is None:
                result = self.episodes.submit(self._call_environment, row.episode, call,
                                              what=f"tool '{call.name}' of {row.env_name}")
            else:
                result = self.runner.submit(call, row.tools, row.hidden_kwargs.get(call.name), problems[index])
            row.waiting.append((call, result))
        row.turn_end = next(self._turn_ends)
        waiting.append(row)
        self._notify_when_done(row)

    def _queue(self, trajectories: list[Trajectory]) -> tuple[collections.deque[Trajectory], list[Trajectory]]:
        """The loop's starting queues: trajectories ready to decode, and those whose episode is starting (its start
        runs on the episode runner; the row decodes once it has one, so a server with room for k sessions serves
        the first k while the others wait for a session to end)."""
        ready: collections.deque[Trajectory] = collections.deque()
        waiting: list[Trajectory] = []
        for row in trajectories:
            if row.starting is None:
                ready.append(row)
                continue
            environment, start = row.starting
            self._await_environment(row, waiting, environment.start, start, what="an episode's start")
        return ready, waiting

    def _await_environment(self, row: Trajectory, waiting: list[Trajectory], fn: Any, arg: Any, what: str) -> None:
        """Run ``fn(arg)`` on the episode runner; ``row`` waits for it as it waits for its tools."""
        row.env_pending = self.episodes.submit(fn, arg, what=what)
        started = time.monotonic()

        def timed(_: concurrent.futures.Future) -> None:  # before the arrival callback: the loop reads it after
            row.env_seconds += time.monotonic() - started
            row.env_steps += 1

        row.env_pending.add_done_callback(timed)
        row.turn_end = next(self._turn_ends)
        waiting.append(row)
        self._notify_when_done(row)

    def _started(self, row: Trajectory) -> bool:
        """Take ``row``'s started episode (True), or make it a failed sample (False)."""
        future, row.env_pending, row.starting = row.env_pending, None, None
        try:
            row.episode = future.result()
            row.env_name = getattr(row.episode, "name", None) or row.env_name
            return True
        except Exception as exc:  # the environment's failure is this sample's
            fail(row, exc)
            return False

    def _call_environment(self, episode: Any, call: ToolCall) -> ToolResult:
        """One of the tools an episode brings, on the episode runner: its answer, or what it raised."""
        try:
            return self.runner.answer(episode.call(call.name, call.arguments or {}))
        except Exception as exc:  # the model sees the error, worded as the ToolRunner words it
            return failed(f"'{call.name}' failed: {exc}")

    def _ended(self, row: Trajectory) -> None:
        """``row`` is finished: its episode closes now (a session a server holds for it is free for another); an
        episode with an ``outcome`` (an env: class's reward) has it read first, however the trajectory ended."""
        if row.episode is not None:
            episode, row.episode = row.episode, None
            outcome = callable(getattr(episode, "outcome", None))
            if outcome:  # the whole response, as the reward manager decodes it for a rule
                text = self.tokenizer.decode(row.ids, skip_special_tokens=True)
                finish = lambda: (episode.outcome(text), episode.close())[0]  # noqa: E731
            else:
                finish = episode.close
            self.closing.append((row, self.episodes.submit(finish, what="an episode's close"), outcome))

    def _environment_answers(self, row: Trajectory) -> bool:
        """Whether the episode gets this turn: replies left (``max_user_turns``), a turn and budget to answer in."""
        limit = self.config.max_user_turns
        return ((limit is None or row.user_turns < limit) and row.turns < self.config.max_assistant_turns
                and len(row.ids) < self.budget)

    def _notify_when_done(self, row: Trajectory) -> None:
        """Put ``row`` on the arrival queue when the last of its tool results (or its environment's reply)
        completes (at once when all have)."""
        futures = [future for _, future in row.waiting] + ([row.env_pending] if row.env_pending else [])
        if len(futures) == 1:
            futures[0].add_done_callback(lambda _: self._arrived.put(row))
            return
        remaining, lock = [len(futures)], threading.Lock()

        def one_done(_: concurrent.futures.Future) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self._arrived.put(row)

        for future in futures:
            future.add_done_callback(one_done)

    def _tool_messages(self, row: Trajectory) -> list[dict[str, Any]]:
        """The tool turn's messages from ``row``'s finished calls (their trace recorded)."""
        messages = []
        for call, future in row.waiting:
            try:
                result = future.result()
            except EpisodeError as exc:  # an environment's tool past the deadline
                result = failed(str(exc))
            row.tool_errors += int(not result.ok)
            row.trace.append({"turn": row.turns, "name": call.name, "arguments": call.arguments,
                              "result": result.content, "error": result.error})
            messages.append({"role": "tool", "name": call.name, "tool_call_id": call.id, "content": result.content})
        row.waiting = []
        return messages

    def _environment_reply(self, row: Trajectory) -> list[dict[str, Any]] | None:
        """The episode's answer to the turn: its messages, or None when it is done (or failed: the row is then a
        failed sample, ``env_error`` set). Its reward sits at the turn's last generated id (its eos)."""
        future, row.env_pending = row.env_pending, None
        try:
            observation = future.result()
            if not isinstance(observation, Observation):
                raise EpisodeError(f"step() must return an Observation; got {type(observation).__name__}")
            observation.checked(f"environment '{row.env_name}'")
        except Exception as exc:  # an environment's failure is the sample's, never the rollout's
            fail(row, exc)
            return None
        if observation.reward is not None:
            row.turn_rewards.append((len(row.ids) - 1, float(observation.reward)))
        if observation.done:
            row.finish = "stop"
            return None
        calls, row.env_calls = row.env_calls, None
        if calls is None:
            row.user_turns += 1
            return observation.messages
        for call, message in zip(calls, observation.messages, strict=False):  # its tool answers, traced as ours
            error = message["content"][len("error: "):] if message["content"].startswith("error: ") else None
            row.tool_errors += int(error is not None)
            row.trace.append({"turn": row.turns, "name": call.name, "arguments": call.arguments,
                              "result": message["content"], "error": error})
        return observation.messages

    def _release(self, row: Trajectory) -> None:
        """``row`` ended while waiting for its tools: whatever the engine keeps for it can go."""

    def _collect_tool_results(self, waiting: list[Trajectory], ready: collections.deque[Trajectory],
                              block: bool) -> None:
        """Move trajectories whose tool results have all arrived to ``ready``, with their tool turn appended; with
        ``block`` (nothing else to do), wait for the first one."""
        if not waiting:
            return
        arrived = [self._arrived.get()] if block else []
        while True:
            try:
                arrived.append(self._arrived.get_nowait())
            except queue.Empty:
                break
        # Only this rollout's waiting rows (a rollout that raised may have left arrivals behind), in turn-end order.
        for row in sorted((r for r in arrived if (r.waiting or r.env_pending) and r in waiting),
                          key=lambda r: r.turn_end):
            waiting.remove(row)
            if row.starting is not None:  # its episode started: it decodes its first turn
                if self._started(row):
                    ready.append(row)
                continue
            messages = self._environment_reply(row) if row.env_pending is not None else self._tool_messages(row)
            if messages is None:  # the episode ended (done, or failed)
                self._ended(row)
                self._release(row)
                continue
            if row.messages is not None:
                row.messages.extend(messages)
            turn = self.conversation(row).turn_ids(messages)
            room = self.budget - len(row.ids)
            for token in turn[:room]:
                row.append(token, generated=False)
            if len(turn) >= room or len(row.prompt_ids) + len(row.ids) >= self.max_positions:
                row.finish = "length"  # no room left to answer
                self._ended(row)
                self._release(row)
                continue
            row.turn_start = len(row.ids)
            ready.append(row)


class DecodeSlots:
    """What the decode loop keeps per trajectory in arrays indexed by ``Trajectory.slot`` (``N`` trajectories),
    so a step costs a few array ops however many rows it decodes, not Python work per row and token: each
    trajectory's uniform draws (its own generator's stream, drawn ``DRAWS`` at a time) and the ids it generated
    since it last joined the batch, with their log-probs, moved into its lists (``flush``) when it leaves (ends a
    turn, or its trajectory). NumPy, not torch: these are a few hundred elements, where a torch op's dispatch
    (~10 us) costs more than a Python loop over the rows."""

    DRAWS = 64

    def __init__(self, trajectories: list[Trajectory], budget: int, max_positions: int):
        count = len(trajectories)
        self.trajectories = trajectories
        self.uniforms = np.zeros((count, self.DRAWS), dtype=np.float64)
        self.used = np.full(count, self.DRAWS, dtype=np.int64)  # draws taken from ``uniforms``' row
        self.ids = np.zeros((count, max(1, budget)), dtype=np.int64)
        self.log_probs = np.zeros((count, max(1, budget)), dtype=np.float32)
        self.pending = np.zeros(count, dtype=np.int64)  # ids generated since the last flush
        self.flushed = np.zeros(count, dtype=np.int64)  # len(trajectory.ids) at the last flush
        # Where a trajectory must stop: the response budget, or the model's positions.
        self.limit = np.array([min(budget, max_positions - len(t.prompt_ids)) for t in trajectories], dtype=np.int64)

    def join(self, rows: list[Trajectory]) -> None:
        """Rows about to decode again (their ids all in their lists: tool turns may have been appended)."""
        for row in rows:
            self.flushed[row.slot] = len(row.ids)

    def draw(self, slots: np.ndarray) -> torch.Tensor:
        """The next uniform of each slot's stream ``(len(slots), 1)`` float64."""
        used = self.used[slots]
        empty = np.flatnonzero(used == self.DRAWS)
        for slot in slots[empty].tolist():
            generator = self.trajectories[slot].generator
            self.uniforms[slot] = torch.rand(self.DRAWS, generator=generator, dtype=torch.float64,
                                             device=generator.device).cpu().numpy()
        used[empty] = 0
        self.used[slots] = used + 1
        return torch.from_numpy(self.uniforms[slots, used]).unsqueeze(-1)

    def record(self, slots: np.ndarray, tokens: np.ndarray, log_probs: np.ndarray) -> np.ndarray:
        """Append each slot's sampled id and its log-prob; returns which slots reached their limit ``(len,)``."""
        at = self.pending[slots]
        self.ids[slots, at] = tokens
        self.log_probs[slots, at] = log_probs
        self.pending[slots] = at + 1
        return self.flushed[slots] + at + 1 >= self.limit[slots]

    def flush(self, row: Trajectory) -> None:
        """Move the slot's pending ids into the trajectory's lists (1 in the loss mask: the model generated them)."""
        count = int(self.pending[row.slot])
        if count:
            row.ids.extend(self.ids[row.slot, :count].tolist())
            row.log_probs.extend(self.log_probs[row.slot, :count].tolist())
            row.mask.extend([1] * count)
            self.pending[row.slot] = 0
            self.flushed[row.slot] += count


class AgentLoop(ToolTurns):
    """Runs trajectories to the end on a transformers model: continuous batching, tools off the decode path.

    With ``max_num_seqs`` (vLLM's name) at most that many rows decode at once; the other trajectories queue, first
    come first served, and take the place of a row that ends or leaves to wait for its tools, so a tool's wait is
    filled with other trajectories' decoding, as vLLM's scheduler fills it. Every trajectory keeps one slot of a
    ``SlotCache`` from its prefill to its end (a waiting row keeps its KV cache, not its place in the step): rows
    leave and rejoin a step without their caches being copied."""

    JOIN_BUNCH = 8  # queued trajectories join once an eighth of the width is free (``_admit``)
    # A slot store up to this size is kept for the next rollout (a larger one, e.g. SmolLM2's validation rollouts,
    # ~1.2 GB, is handed back rather than held through the update).
    KEEP_STORE_BYTES = 512 * 1024 * 1024
    EXTEND_SPREAD = 8  # rows back from their tools extend together when their new ids differ by at most this

    def __init__(self, model: torch.nn.Module, tokenizer: Any, runner: ToolRunner, tool_set: ToolSet,
                 config: MultiTurnConfig, max_response_length: int, template: str,
                 autocast_dtype: torch.dtype | None = None, max_num_seqs: int | None = None):
        max_positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        super().__init__(tokenizer, runner, tool_set, config, max_response_length, template, max_positions)
        self.model = model
        self.autocast_dtype = autocast_dtype
        self.max_num_seqs = max_num_seqs
        self._store: SlotCache | None = None

    @torch.no_grad()
    @packed_weights(trainable=True)  # linear layers multiply by oneDNN-packed weights, as in the single-turn sampler
    @fused_decoder_layers()  # and the decoder layers' small ops fused, as there
    def run(self, trajectories: list[Trajectory], params: SamplingParams) -> None:
        """Decode every trajectory to its end (``Trajectory.finish`` set)."""
        for slot, row in enumerate(trajectories):
            row.slot = slot
        self._slots = DecodeSlots(trajectories, self.budget, self.max_positions)
        ready, waiting = self._queue(trajectories)
        longest = max((len(row.prompt_ids) for row in trajectories), default=1)
        # A slot for every trajectory, each with room for its prompt, the response budget and some padding (an
        # extend's, a prefill's): a store's pages are touched only as slots are used, and growing it copies it all.
        # Kept for the next rollout when small enough (``SlotCache.reset``: fresh pages cost a fault each).
        slots = len(trajectories)
        columns = min(self.max_positions, longest + self.budget) + 2 * self.EXTEND_SPREAD
        gather = self.model.config._attn_implementation != CPU_ATTENTION
        device = next(self.model.parameters()).device
        if self._store is not None and self._store.fits(slots, columns, gather) and self._store.mask.device == device:
            self._store.reset()
        else:
            self._store = SlotCache(self.model.config, slots=slots, columns=columns, gather=gather, device=device)
        decoding: list[Trajectory] = []
        cache_rows = np.zeros(0, dtype=np.int64)  # the decoding rows' slots
        next_tokens = torch.zeros(0, dtype=torch.long)  # their next input ids
        warpers = logits_warpers(params)
        while ready or decoding or waiting:
            self._collect_tool_results(waiting, ready, block=not ready and not decoding)
            for rows in self._admit(ready, len(decoding)):
                self._slots.join(rows)
                logits = (self._extend if rows[0].cache_slot is not None else self._prefill)(rows, device)
                keep, tokens = self._advance(rows, logits, params, warpers, waiting)
                self._leave(rows, keep)
                decoding += [rows[i] for i in keep]
                cache_rows = np.concatenate([cache_rows, [rows[i].cache_slot for i in keep]]).astype(np.int64)
                next_tokens = torch.cat([next_tokens, tokens[keep].cpu()])
            if decoding:
                step = self._store.step(cache_rows)
                logits = self._forward(device, input_ids=next_tokens.unsqueeze(-1).to(device), **step)
                keep, tokens = self._advance(decoding, logits, params, warpers, waiting)
                if len(keep) < len(decoding):
                    self._leave(decoding, keep)
                    decoding = [decoding[i] for i in keep]
                    cache_rows, tokens = cache_rows[keep], tokens[keep]
                next_tokens = tokens.cpu()
        if self._store.nbytes() > self.KEEP_STORE_BYTES:
            self._store = None

    def _leave(self, rows: list[Trajectory], keep: list[int]) -> None:
        """Rows not in ``keep`` stop decoding: an ended trajectory frees its slot; one that waits for its tools keeps
        it, and notes how many of its ids the cache holds (the eos just sampled is not fed yet)."""
        if len(keep) == len(rows):
            return
        kept = set(keep)
        for i, row in enumerate(rows):
            if i in kept:
                continue
            if row.finish is not None:
                self._release(row)
            else:
                row.cached = len(row.prompt_ids) + len(row.ids) - 1

    def _release(self, row: Trajectory) -> None:
        if row.cache_slot is not None:
            self._store.release([row.cache_slot])
        row.cache_slot = None

    def _admit(self, ready: collections.deque[Trajectory], decoding: int) -> list[list[Trajectory]]:
        """Take trajectories off the queue for the free places (all of them without ``max_num_seqs``), as groups
        that each run one forward: fresh ones (a prefill), ones back from their tools (an extend). While rows are
        decoding, wait until the free places take a bunch (an eighth of the width, or all that wait): each join runs
        a forward of its own, too costly for one row at a time (measured: a sixteenth or one row was slower).

        Rows back from their tools extend by different numbers of ids (a tool turn with a long result, such as an
        error message, can be ten times the usual); an extend pads each row's new ids to the group's longest, and
        that padding stays inside the row for the rest of its trajectory, widening every later step's cache. So
        they extend in groups whose lengths differ by at most ``EXTEND_SPREAD`` ids."""
        if not ready:
            return []
        slots = len(ready) if self.max_num_seqs is None else self.max_num_seqs - decoding
        if decoding and slots < min(len(ready), max(1, (self.max_num_seqs or 0) // self.JOIN_BUNCH)):
            return []
        rows = [ready.popleft() for _ in range(min(slots, len(ready)))]
        fresh = [row for row in rows if row.cache_slot is None]
        groups = [fresh] if fresh else []
        back = sorted((row for row in rows if row.cache_slot is not None), key=self._pending_length)
        while back:
            shortest = self._pending_length(back[0])
            count = next((i for i, row in enumerate(back) if self._pending_length(row) > shortest + self.EXTEND_SPREAD),
                         len(back))
            groups.append(back[:count])
            back = back[count:]
        return groups

    @staticmethod
    def _pending_length(row: Trajectory) -> int:
        return len(row.prompt_ids) + len(row.ids) - row.cached

    # ---------------------------------------------------------------- decoding

    def _extend(self, rows: list[Trajectory], device: torch.device) -> torch.Tensor:
        """Rows back from their tools: one forward over the ids each has not fed yet (the turn's eos, then the tool
        turn; left-padded to the group's longest), appended to their slots in place; next-token logits
        ``(rows, vocab)``. The padding is masked out and position ids count real tokens only, so the result is the
        row's full forward."""
        ids, new_mask = pad_tokens([(row.prompt_ids + row.ids)[row.cached:] for row in rows],
                                    self.tokenizer.pad_token_id or 0)
        slots = np.fromiter((row.cache_slot for row in rows), dtype=np.int64, count=len(rows))
        step = self._store.step(slots, new_mask.to(device))
        return self._forward(device, input_ids=ids.to(device), logits_to_keep=1, **step)

    def _prefill(self, rows: list[Trajectory], device: torch.device) -> torch.Tensor:
        """One forward over each row's ids so far (left-padded) into a fresh slot per row: next-token logits
        ``(rows, vocab)``. Rows with the same ids (a prompt's ``n`` samples at the start) are computed once, in the
        first one's slot, and the others copy that slot, as the single-turn sampler shares a prompt's prefill. The
        prefill writes into the store directly: a separate prefill cache beside the store was a second copy of
        every prompt's K/V at the rollout's peak (+1.4 GB for SmolLM2's 64-story validation)."""
        sequences = [tuple(row.prompt_ids + row.ids) for row in rows]
        slots = self._store.allocate(len(rows))
        first: dict[tuple[int, ...], int] = {}  # each distinct sequence -> the slot it is computed in
        for row, slot, sequence in zip(rows, slots, sequences, strict=True):
            row.cache_slot = slot
            first.setdefault(sequence, slot)
        unique = list(first)
        ids, mask = pad_tokens(unique, self.tokenizer.pad_token_id or 0)
        step = self._store.step(np.fromiter(first.values(), dtype=np.int64, count=len(first)), mask.to(device))
        logits = self._forward(device, input_ids=ids.to(device), logits_to_keep=1, **step)
        if len(unique) == len(rows):
            return logits
        sharing = [(first[sequence], slot) for sequence, slot in zip(sequences, slots, strict=True)
                   if first[sequence] != slot]
        self._store.copy([source for source, _ in sharing], [target for _, target in sharing])
        position = {sequence: i for i, sequence in enumerate(unique)}
        index = torch.tensor([position[s] for s in sequences], dtype=torch.long, device=device)
        return logits.index_select(0, index)

    def _advance(self, rows: list[Trajectory], logits: torch.Tensor, params: SamplingParams, warpers: Any,
                 waiting: list[Trajectory]) -> tuple[list[int], torch.Tensor]:
        """Sample each row's next id from ``logits`` ``(rows, vocab)``, append it, and end turns and trajectories;
        returns the rows that keep decoding and every row's sampled id ``(rows,)``."""
        temperature = 1.0 if params.greedy else params.temperature
        slots = np.fromiter((row.slot for row in rows), dtype=np.int64, count=len(rows))
        if params.greedy:
            tokens = logits.argmax(-1)
        else:
            scores = warpers(None, logits) if warpers else logits
            uniform = self._slots.draw(slots).to(logits.device)
            tokens = draw_categorical(torch.softmax(scores, dim=-1), uniform=uniform)
        if params.logprobs:  # the trainer asks (they become the old log-probs); evaluation does not
            behaviour = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
            chosen = behaviour.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).float().cpu().numpy()
        else:
            chosen = np.zeros(len(rows), dtype=np.float32)
        drawn = tokens.cpu().numpy()
        ending = (drawn == self.eos_id) | self._slots.record(slots, drawn, chosen)
        if not ending.any():
            return list(range(len(rows))), tokens
        for i in np.flatnonzero(ending).tolist():
            row = rows[i]
            self._slots.flush(row)
            if row.ids[-1] == self.eos_id:
                self._end_turn(row, waiting)
            else:  # the budget or the positions
                row.finish = "length"
                row.turns += 1  # the turn the budget cut is still an assistant turn
                self._ended(row)
        return np.flatnonzero(~ending).tolist(), tokens

    def _forward(self, device: torch.device, **inputs: Any) -> torch.Tensor:
        """The model's next-token logits ``(rows, vocab)``, at least float32, under ``model.autocast_dtype``."""
        with autocast_context(device, self.autocast_dtype):
            return at_least_float32(self.model(**inputs).logits[:, -1, :])


class AgentRollout(RolloutEngine):
    """The multi-turn rollout engine: the same interface as the single-turn ones, over the engine it wraps
    (``engine``: an ``HFRollout`` decoding the actor's own model, or a ``VLLMRollout``), whose ``agent_loop``
    gives the engine's way of decoding turns; the turn logic and the tools are the same for both."""

    name = "agent"

    def __init__(self, engine: RolloutEngine, config: MultiTurnConfig, max_response_length: int):
        self.engine = engine
        self.config = config
        prompting = ToolPrompting.from_config(config, engine.tokenizer)
        self.tool_set = prompting.tool_set
        self.runner = ToolRunner(self.tool_set, max_response_chars=config.max_tool_response_length,
                                 processes=config.tool_processes, threads=config.tool_threads)
        self.loop = engine.agent_loop(self.runner, self.tool_set, config, max_response_length, prompting.template)
        self.loop.prompting = prompting
        self.environment = None  # the run's: verl's interactions answer the turns that call no tool
        self._row_environments: dict[str, Any] = {}  # rows that name their own (an openenv: source's)
        if config.interaction_config_path:
            from verl.envs.interaction import InteractionEnvironment, load_interactions  # noqa: PLC0415

            self.environment = InteractionEnvironment(load_interactions(config.interaction_config_path),
                                                      self._episodes())

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        """``prompts`` as for any engine (left-padded ids; ``tool_names`` / ``tool_kwargs`` per row when the
        dataset gives them, else every configured tool) -> one row per trajectory (see the module docstring)."""
        model = getattr(self.engine, "model", None)  # the transformers engine decodes the actor's module itself
        was_training = model is not None and model.training
        if model is not None:
            model.eval()
        trajectories: list[Trajectory] = []
        try:
            trajectories = self._start(prompts, params)
            self.loop.run([t for t in trajectories if t.finish is None], params)
        finally:
            if model is not None:
                model.train(was_training)
            self._close_episodes(trajectories)
        return assemble_trajectories(prompts, trajectories, params.n, self.engine.tokenizer.pad_token_id,
                                     log_probs=self.loop.gives_log_probs and params.logprobs)

    def _start(self, prompts: DataProto, params: SamplingParams) -> list[Trajectory]:
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
        non = prompts.non_tensor
        base = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        trajectories = []
        for i in range(len(prompts)):
            prompt_ids = ids[i][mask[i].bool()].tolist()
            tools = list(non["tool_names"][i]) if "tool_names" in non else self.tool_set.names()
            hidden = dict(non["tool_kwargs"][i] or {}) if "tool_kwargs" in non else {}
            prompt_id = int(non["index"][i]) if "index" in non else i
            for sample in range(params.n):
                generator = None
                if not params.greedy:
                    generator = torch.Generator(device=ids.device)
                    generator.manual_seed(((base * 1_000_003 + prompt_id) * 1_000_003 + sample) % 2**63)
                trajectories.append(Trajectory(prompt_ids, tools, hidden, generator))
                environment = self._environment_for(non["extra_info"][i] if "extra_info" in non else None)
                if environment is not None:
                    self._start_episode(trajectories[-1], non, i, environment)
        return trajectories

    def _episodes(self) -> EpisodeRunner:
        if self.loop.episodes is None:
            self.loop.episodes = EpisodeRunner(self.config.env_timeout_s)
        return self.loop.episodes

    def _environment_for(self, extra_info: Any) -> Any:
        """The environment a row's episodes run in: the one its source named (``extra_info.env``), else the run's."""
        spec = extra_info.get("env") if isinstance(extra_info, dict) else None
        if not isinstance(spec, dict):
            return self.environment
        kind = spec.get("kind")
        if kind not in self._row_environments:
            if kind == "openenv":
                from verl.envs.openenv import OpenEnvEnvironment  # noqa: PLC0415 - lazy: openenv is optional

                self._row_environments[kind] = OpenEnvEnvironment(self.config.env_timeout_s)
            elif kind == "env":
                from verl.envs.classes import ClassEnvironment  # noqa: PLC0415

                self._row_environments[kind] = ClassEnvironment()
            else:
                raise EpisodeError(f"a row names the environment kind {kind!r}; known: openenv, env")
            self._episodes()
        return self._row_environments[kind]

    def _start_episode(self, row: Trajectory, non: dict[str, Any], i: int, environment: Any) -> None:
        """``row``'s episode from its dataset row (a start that fails makes it a failed sample, never decoded)."""
        messages = non["prompt_messages"][i] if "prompt_messages" in non else [
            {"role": "user", "content": str(non["raw_prompt"][i])}]
        row.messages = [dict(m) for m in messages]
        start = {"extra_info": non["extra_info"][i], "ground_truth": non["ground_truth"][i],
                 "messages": list(row.messages)}
        row.env_name = environment.name
        row.starting = (environment, start)  # started by the loop (``ToolTurns._queue``)

    def _close_episodes(self, trajectories: list[Trajectory]) -> None:
        """Every episode's ``close`` (those the loop has not closed yet now); a failing close is logged, not raised."""
        if self.loop.episodes is None:
            return
        for row in trajectories:
            row.starting = None
            self.loop._ended(row)
        closing, self.loop.closing[:] = list(self.loop.closing), []
        for row, future, outcome in closing:
            try:
                reward = future.result()
            except Exception as exc:
                if outcome:  # the episode's reward could not be read: the sample failed
                    fail(row, exc)
                    continue
                from verl.utils import log  # noqa: PLC0415

                log.info("environment", level="WARNING", env=row.env_name, close_failed=f"{type(exc).__name__}: {exc}")
                continue
            if outcome and reward is not None and row.env_error is None:
                last = max((i for i, m in enumerate(row.mask) if m), default=None)  # the last generated id
                if last is not None:
                    row.turn_rewards.append((last, float(reward)))

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.engine.sync_weights(model)

    def shutdown(self) -> None:
        self.runner.shutdown()
        if self.loop.episodes is not None:
            self.loop.episodes.shutdown()
        self.engine.shutdown()


def assemble_trajectories(prompts: DataProto, trajectories: list[Trajectory], n: int, pad_id: int,
                          log_probs: bool = True) -> DataProto:
    """The rollout output for finished trajectories (rows ``prompts x n``): as ``assemble_rollout``'s, except
    that ``response_mask`` is the loss mask (0 on tool turns) and ``attention_mask`` covers every response id.
    ``log_probs``: whether the trajectories carry behaviour log-probs (``rollout_log_probs``); without them the
    trainer recomputes the old log-probs in one forward, as for the single-turn vLLM engine."""
    rows = len(trajectories)
    width = max(1, max(len(t.ids) for t in trajectories))
    responses = torch.full((rows, width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((rows, width), dtype=torch.long)
    present = torch.zeros((rows, width), dtype=torch.long)
    behaviour = torch.zeros((rows, width), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        length = len(t.ids)
        responses[i, :length] = torch.tensor(t.ids, dtype=torch.long)
        if t.env_error is None:  # a failed episode's sample is masked: nothing of it is learnt
            loss_mask[i, :length] = torch.tensor(t.mask, dtype=torch.long)
        present[i, :length] = 1
        behaviour[i, :length] = torch.tensor(t.log_probs, dtype=torch.float32)
    prompt_ids = prompts.batch["input_ids"].repeat_interleave(n, dim=0)
    prompt_mask = prompts.batch["attention_mask"].repeat_interleave(n, dim=0)
    attention_mask = torch.cat([prompt_mask, present], dim=1)
    non_tensors = {k: v for k, v in (prompts.repeat(n).non_tensor if n > 1 else prompts.non_tensor).items()}
    non_tensors.update(
        num_turns=np.array([t.turns for t in trajectories], dtype=np.int64),
        num_tool_calls=np.array([t.calls for t in trajectories], dtype=np.int64),
        num_valid_calls=np.array([t.valid_calls for t in trajectories], dtype=np.int64),
        num_tool_errors=np.array([t.tool_errors for t in trajectories], dtype=np.int64),
        finish_reason=[t.finish or "length" for t in trajectories],
        tool_trace=[list(t.trace) for t in trajectories],  # DataProto keeps each row's list as one object
        turn_rewards=[list(t.turn_rewards) for t in trajectories],
        env_error=np.array([t.env_error for t in trajectories], dtype=object),
        env_name=np.array([t.env_name for t in trajectories], dtype=object),
        env_seconds=np.array([t.env_seconds for t in trajectories], dtype=np.float64),
        env_steps=np.array([t.env_steps for t in trajectories], dtype=np.int64),
    )
    tensors = {"prompts": prompt_ids, "responses": responses, "response_mask": loss_mask,
               "input_ids": torch.cat([prompt_ids, responses], dim=1), "attention_mask": attention_mask,
               "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask}
    if log_probs:
        tensors["rollout_log_probs"] = behaviour * loss_mask
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta=dict(prompts.meta), stage="rollout")
