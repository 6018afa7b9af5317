"""Multi-turn rollouts on the vLLM engine (``rollout.name=vllm`` with ``rollout.multi_turn.enable``).

The turn logic is the transformers loop's (``ToolTurns``: parse the calls, run them on the ``ToolRunner``, append
the tool turn's template ids); only the decoding differs. Each assistant turn is one vLLM request whose prompt is
the trajectory's ids so far, as token ids (token-in, token-out: generated text is never re-tokenized). Requests
enter the engine (``LLMEngine.add_request``) as trajectories become ready and ``LLMEngine.step`` advances all of
them together, so a trajectory waiting for its tools simply has no request in the engine while the others keep
decoding (vLLM's continuous batching). When it comes back, its re-sent ids hit vLLM's prefix cache and only the new
ones (the turn's eos and the tool turn) are prefilled: what the transformers loop gets by keeping the row's cache.

Sampling: a turn's request is seeded from the trajectory's seed (``AgentRollout`` derives it from the call seed,
the prompt id and the sample number) and the turn number, so a rollout does not depend on tool timing or on which
trajectories share a step. With ``SamplingParams.logprobs`` (the trainer asks by default, for the mismatch metrics
and ``algorithm.rollout_correction``) each generated id keeps vLLM's log-prob of it — processed, i.e. after the
temperature, as the trainer's forward computes it — and tool-turn ids keep 0 (they are masked out of the loss).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from verl.config import MultiTurnConfig
from verl.rollout.agent_loop import ToolTurns, Trajectory
from verl.rollout.base import SamplingParams
from verl.tools.registry import ToolSet
from verl.tools.runner import ToolRunner

if TYPE_CHECKING:
    import vllm

_REQUEST_IDS = itertools.count()  # process-wide, so two loops on one engine never reuse a request id


def vllm_sampling(params: SamplingParams, eos_id: int, **request: Any) -> vllm.SamplingParams:
    """vLLM's sampling parameters for ``params`` (greedy: temperature 0, no top-p/top-k), stopping at ``eos_id``, with
    the request's own fields (``n``, ``max_tokens``, ``seed``, ...); token ids only (``detokenize=False``: the
    trainer decodes), and ``logprobs=0`` when asked: only the drawn id's log-prob at each position."""
    import vllm  # noqa: PLC0415  (only with rollout.name=vllm)

    return vllm.SamplingParams(
        temperature=0.0 if params.greedy else float(params.temperature),
        top_p=1.0 if params.greedy else float(params.top_p),
        top_k=0 if params.greedy or params.top_k <= 0 else int(params.top_k),  # 0 (or -1) disables top-k
        logprobs=0 if params.logprobs else None, stop_token_ids=[eos_id], detokenize=False, **request)


class VLLMAgentLoop(ToolTurns):
    """Runs trajectories to the end on a ``vllm.LLM``: one engine request per assistant turn."""

    gives_log_probs = True  # when asked (params.logprobs): vLLM's log-prob of each drawn id

    def __init__(self, llm: vllm.LLM, tokenizer: Any, runner: ToolRunner, tool_set: ToolSet,
                 config: MultiTurnConfig, max_response_length: int, template: str):
        max_positions = int(llm.llm_engine.model_config.max_model_len)
        super().__init__(tokenizer, runner, tool_set, config, max_response_length, template, max_positions)
        self.llm = llm

    def run(self, trajectories: list[Trajectory], params: SamplingParams) -> None:
        from vllm.inputs import TokensPrompt  # vllm is imported where it is used (the engine module needs it anyway)

        engine = self.llm.llm_engine
        ready, waiting = self._queue(trajectories)
        running: dict[str, Trajectory] = {}
        try:
            while ready or running or waiting:
                self._collect_tool_results(waiting, ready, block=not ready and not running)
                while ready:
                    row = ready.popleft()
                    request_id = f"verl-agent-{next(_REQUEST_IDS)}"
                    engine.add_request(request_id, TokensPrompt(prompt_token_ids=row.prompt_ids + row.ids),
                                       self._turn_params(row, params))
                    running[request_id] = row
                if running:
                    for output in engine.step():
                        if output.finished and output.request_id in running:
                            sample = output.outputs[0]
                            self._take_turn(running.pop(output.request_id), list(sample.token_ids), waiting,
                                            sample.logprobs)
        finally:
            if running:  # an error mid-rollout: leave the engine empty for the next call
                engine.abort_request(list(running))

    def _turn_params(self, row: Trajectory, params: SamplingParams) -> vllm.SamplingParams:
        """The request for ``row``'s next turn: the room left in the response budget and the context."""
        from vllm.sampling_params import RequestOutputKind

        room = min(self.budget - len(row.ids), self.max_positions - len(row.prompt_ids) - len(row.ids))
        seed = None
        if row.generator is not None:
            seed = (row.generator.initial_seed() * 1_000_003 + row.turns) % (2**63 - 1)
        # Decoded here, with the tokenizer the trainer uses.
        return vllm_sampling(params, self.eos_id, n=1, max_tokens=max(1, room), seed=seed,
                             output_kind=RequestOutputKind.FINAL_ONLY)

    def _take_turn(self, row: Trajectory, tokens: list[int], waiting: list[Trajectory],
                   logprobs: list[dict[int, Any]] | None = None) -> None:
        """Append a finished turn's ids (with their log-probs, where the request asked for them); the turn ends with
        eos (calls to run, or the answer) or at the budget."""
        for position, token in enumerate(tokens):
            row.append(token, generated=True, log_prob=float(logprobs[position][token].logprob) if logprobs else 0.0)
        if tokens and tokens[-1] == self.eos_id:
            self._end_turn(row, waiting)
        else:
            row.finish = "length"
            row.turns += 1  # the turn the budget cut is still an assistant turn
            self._ended(row)
