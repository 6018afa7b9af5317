"""``verl train`` with your agent (``rollout.gateway``): the rollout engine that serves the current policy over the
OpenAI API and learns from what your agent's calls sampled (docs/agents.md, "Your agent").

Per rollout:

1. The service (``create_app``: the transformers engine, continuous batching) runs in this process on 127.0.0.1 with
   a fresh training key and admin key. Each prompt row is given to the agent ``rollout.n`` times, each an *episode*
   with its own id; at most ``max_concurrent_episodes`` at once. A Python agent gets an ``openai.OpenAI`` client
   whose every call carries the training key and the episode (``X-Session-ID``) and the row as a dict; a command
   gets ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``VERL_EPISODE_ID`` and the row as JSON on stdin (it sends the
   episode as the ``X-Session-ID`` header, or as ``verl.episode_id`` in the body).
2. Once the episodes ended and their last calls were recorded, the records (``GET /admin/records``: prompt ids as
   rendered, sampled ids, log-probs, weight versions) become samples token-exact (``verl.rollout.recorded_episodes``:
   one multi-turn sample per history the agent kept extending, the tool and user tokens masked; a rewritten history
   starts another sample of the same episode). Every sample keeps its prompt row's fields, so its reward and its
   GRPO group are the row's.
3. The episode's reward is what the agent returned (source ``env:gateway``, at each sample's last generated token);
   ``None`` leaves it to the run's reward (the data source's rule, a reward model) on the sample's text. An agent
   that raised, timed out or never called the model gives one masked sample with the reason (counted, never a 0).
4. ``sync_weights`` (after every update) saves the actor's weights (a LoRA actor: its adapter) and sends them with
   ``POST /update_weights``, so the next rollout samples with them in place; their version is the update count.

The serving side is ``serve``'s own; ``verl/`` reaches it only through the ``verl.gateways`` entry point.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from typing import Any

import httpx
import numpy as np
import torch
import uvicorn

from serve import log
from serve.api import create_app
from serve.settings import load_settings
from verl.errors import ConfigError
from verl.protocol import DataProto
from verl.rollout.agent_loop import Trajectory
from verl.rollout.base import EngineSpec, RolloutEngine, SamplingParams
from verl.rollout.recorded_episodes import EpisodeSamples, episode_samples, samples_batch
from verl.utils.imports import load_attribute

SERVED_NAME = "policy"
REWARD_SOURCE = "gateway"  # the environment name of agent-returned rewards (source env:gateway)


class ServedPolicy:
    """The service on a loopback port in a background thread (uvicorn), for the trainer's own agent traffic."""

    def __init__(self, model_path: str, max_model_len: int, max_tokens: int, slots: int, timeout_s: float,
                 seed: int):
        self.training_key, self.admin_key = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        settings = load_settings(model=model_path, served_model_name=SERVED_NAME, engine="transformers",
                                 torch_threads=torch.get_num_threads(), seed=seed, admin_api_key=self.admin_key,
                                 training_api_key=self.training_key, training_max_slots_share=1.0,
                                 max_batch_size=slots, max_queue_size=4 * slots, max_output_tokens=max_model_len,
                                 default_max_tokens=max_tokens, max_n=1, request_timeout_s=timeout_s,
                                 records_max_completions=100_000)
        self.app = create_app(settings)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, name="verl-gateway", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 300
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError(f"rollout.gateway: the policy service did not start on {model_path}")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.admin = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.admin_key}"},
                                  timeout=timeout_s)
        while self.admin.get("/health").status_code != 200:  # the model loads after the server starts
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError(f"rollout.gateway: the policy service on {model_path} is not healthy: "
                                  f"{self.admin.get('/health').text}")
            time.sleep(0.05)

    @property
    def service(self) -> Any:
        return self.app.state.service

    def records(self, since: float, episodes: set[str], timeout_s: float) -> dict[str, list[dict]]:
        """The request records of ``episodes`` since ``since``, once no training call is in flight (a call's record
        is written when its sequence is released, just after its answer went out), in arrival order."""
        deadline = time.monotonic() + timeout_s
        while self.service.admission.training_in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        rows = self.admin.get("/admin/records", params={"since": since}).raise_for_status().json()["records"]
        calls: dict[str, list[dict]] = defaultdict(list)
        for row in rows:
            if row.get("kind", "request") == "request" and row.get("episode") in episodes:
                calls[row["episode"]].append(row)
        for rows_of in calls.values():
            rows_of.sort(key=lambda r: (r.get("arrival") or r["time"], r["time"]))
        return calls

    def update_weights(self, path: str, version: int) -> None:
        answer = self.admin.post("/update_weights", json={"update_info": {"path": path, "version": version}})
        if answer.status_code != 200:
            raise RuntimeError(f"rollout.gateway: the policy service refused the new weights: {answer.text}")

    def close(self) -> None:
        self.admin.close()
        self.server.should_exit = True
        self.thread.join(30)


def load_agent(target: str) -> Any:
    agent = load_attribute(target, "rollout.gateway.agent", "verl_user_agent")
    if not callable(agent):
        raise ConfigError(f"rollout.gateway.agent '{target}' is not a function (it is called as agent(client, row))")
    return agent


def as_reward(value: Any, where: str) -> float | None:
    """The agent's return value as a reward (None: the run's reward decides); anything else is an error."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value):
        raise TypeError(f"{where} returned {value!r}: return a finite number (the episode's reward) or None")
    return float(value)


class GatewayRollout(RolloutEngine):
    """Rollouts by your agent against the served policy (the module docstring)."""

    name = "gateway"

    @classmethod
    def build(cls, spec: EngineSpec) -> GatewayRollout:
        return cls(spec)

    def __init__(self, spec: EngineSpec):
        self.config = spec.config.gateway
        self.tokenizer = spec.tokenizer
        self.pad_id = spec.tokenizer.pad_token_id if spec.tokenizer.pad_token_id is not None else 0
        self.agent = load_agent(self.config.agent) if self.config.agent is not None else None
        if self.agent is not None and importlib.util.find_spec("openai") is None:
            raise ConfigError("rollout.gateway.agent is called with an openai.OpenAI client: pip install openai")
        max_tokens = self.config.max_tokens or max(1, spec.max_model_len // 2)
        self.policy = ServedPolicy(spec.model_path, spec.max_model_len, max_tokens,
                                   self.config.max_concurrent_episodes, self.config.episode_timeout_s, spec.seed)
        self.weights_dir = tempfile.mkdtemp(prefix="verl-gateway-weights-")
        self.version = 0
        self.rollouts = 0
        self.seed = spec.seed
        self.sync_weights(spec.model)  # the served weights are the actor's from the first rollout on

    # ------------------------------------------------------------------ weights

    def sync_weights(self, model: torch.nn.Module) -> None:
        """The actor's weights into the running engine, in place (a LoRA actor sends its adapter)."""
        self.version += 1
        path = os.path.join(self.weights_dir, f"v{self.version}")
        model.save_pretrained(path, safe_serialization=True)
        self.policy.update_weights(path, self.version)
        previous = os.path.join(self.weights_dir, f"v{self.version - 1}")
        shutil.rmtree(previous, ignore_errors=True)

    # ------------------------------------------------------------------ rollout

    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        rows = [self._row(prompts, i, params) for i in range(len(prompts))]
        episodes = [(f"r{self.rollouts}-p{i}-s{s}", i, s) for i in range(len(rows)) for s in range(params.n)]
        self.rollouts += 1
        since = time.time() - 1.0
        outcomes = self._run(episodes, rows)
        calls = self.policy.records(since, {e for e, _, _ in episodes}, self.config.episode_timeout_s)
        samples, fields = [], []
        stats: dict[str, float] = dict.fromkeys(("calls", "failed", "rewritten", "rerendered"), 0.0)
        reasons: dict[str, tuple[str, str]] = {}  # one episode per kind of failure, for the log
        for (episode, i, s), (reward, error) in zip(episodes, outcomes, strict=True):
            found = episode_samples(episode, calls.get(episode, []))
            stats["rerendered"] += found.rerendered
            stats["rewritten"] += found.rewritten
            stats["calls"] += found.calls
            if found.first_difference is not None and stats["rerendered"] == found.rerendered:
                log.warning("rollout.gateway: episode %s re-rendered an earlier answer with other ids than sampled "
                            "(%s); that call starts a sample of its own", episode, found.first_difference)
            if error is None and not found.trajectories:
                error = "the agent made no call to the served model (nothing to learn from)"
            if error is not None:
                stats["failed"] += 1
                reasons.setdefault(error.split(":")[0], (episode, error))
                found = self._failed(episode, prompts, i, found, error)
            elif reward is not None:
                for row in found.trajectories:
                    last = max((k for k, m in enumerate(row.mask) if m), default=len(row.ids) - 1)
                    row.turn_rewards, row.env_name = [(last, reward)], REWARD_SOURCE
            samples.append(found)
            fields.append({**{key: values[i] for key, values in prompts.non_tensor.items()}, "episode_sample": s})
        for episode, error in reasons.values():
            log.warning("rollout.gateway: %d of %d episodes failed and are masked; e.g. %s: %s", stats["failed"],
                        len(episodes), episode, error)
        batch = samples_batch(samples, self.pad_id, fields)
        stats["episodes"] = float(len(episodes))
        stats["samples_per_episode"] = len(batch) / max(1, len(episodes))
        batch.meta.update(prompts.meta)
        batch.meta["gateway"] = dict(stats)  # logged per step as gateway/<name> (verl.trainer.step_metrics)
        return batch

    def _row(self, prompts: DataProto, i: int, params: SamplingParams) -> dict[str, Any]:
        """What the agent gets for prompt ``i``: the row's messages, answer and fields, the served model's name and
        the sampling the trainer asks for (temperature, top_p, max_tokens; a seed per episode is added)."""
        non = prompts.non_tensor
        messages = non["prompt_messages"][i] if "prompt_messages" in non else [
            {"role": "user", "content": str(non["raw_prompt"][i])}]
        extra = non["extra_info"][i] if "extra_info" in non else {}
        return {"messages": [dict(m) for m in messages], "ground_truth": non["ground_truth"][i] if "ground_truth" in
                non else None, "data_source": non["data_source"][i] if "data_source" in non else None,
                "extra_info": dict(extra or {}), "index": int(non["index"][i]) if "index" in non else i,
                "model": SERVED_NAME,
                "sampling": {"temperature": params.temperature, "top_p": params.top_p,
                             "max_tokens": self.config.max_tokens or params.max_new_tokens}}

    def _run(self, episodes: list[tuple[str, int, int]], rows: list[dict]) -> list[tuple[float | None, str | None]]:
        """Every episode's (reward, error), run ``max_concurrent_episodes`` at a time."""
        timeout = self.config.episode_timeout_s
        pool = concurrent.futures.ThreadPoolExecutor(self.config.max_concurrent_episodes,
                                                     thread_name_prefix="verl-agent")
        futures = []
        for episode, i, s in episodes:
            row = {**rows[i], "episode_id": episode,
                   "seed": hash((self.seed, self.rollouts, rows[i]["index"], s)) % 2**31}
            futures.append(pool.submit(self._episode, episode, row))
        waves = -(-len(episodes) // self.config.max_concurrent_episodes)
        concurrent.futures.wait(futures, timeout=timeout * waves)
        pool.shutdown(wait=False, cancel_futures=True)  # an episode past its time keeps its thread, not the step
        out = []
        for future in futures:
            if not future.done():
                out.append((None, f"the episode did not end within {timeout:g} s (rollout.gateway.episode_timeout_s)"))
            else:
                out.append(future.result())
        return out

    def _episode(self, episode: str, row: dict) -> tuple[float | None, str | None]:
        try:
            if self.agent is not None:
                return as_reward(self._call_agent(episode, row), f"agent {self.config.agent}"), None
            return self._run_command(episode, row), None
        except Exception as exc:  # the agent's own failure: a masked, counted sample with its reason
            return None, f"{type(exc).__name__}: {exc}"[:500]

    def _call_agent(self, episode: str, row: dict) -> Any:
        import openai  # noqa: PLC0415  (the agent's client: a dependency of Python agents only)

        client = openai.OpenAI(base_url=self.policy.url + "/v1", api_key=self.policy.training_key, max_retries=0,
                               timeout=self.config.episode_timeout_s, default_headers={"X-Session-ID": episode})
        try:
            return self.agent(client, row)
        finally:
            client.close()

    def _run_command(self, episode: str, row: dict) -> float | None:
        env = {**os.environ, "OPENAI_BASE_URL": self.policy.url + "/v1", "OPENAI_API_KEY": self.policy.training_key,
               "VERL_EPISODE_ID": episode}
        done = subprocess.run(self.config.command, input=json.dumps(row, default=str), env=env, text=True,
                              capture_output=True, timeout=self.config.episode_timeout_s)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
            raise RuntimeError(f"the agent command exited {done.returncode}: {tail[0][:300]}")
        lines = done.stdout.strip().splitlines()
        try:
            return as_reward(float(lines[-1]), "the agent command") if lines else None
        except ValueError:
            return None  # its last line is not a number: the run's reward scores the episode

    def _failed(self, episode: str, prompts: DataProto, i: int, found: EpisodeSamples, error: str) -> EpisodeSamples:
        """A failed episode as masked samples: those it recorded, else one empty sample on the dataset's prompt."""
        if not found.trajectories:
            ids = prompts.batch["input_ids"][i][prompts.batch["attention_mask"][i].bool()].tolist()
            found.trajectories.append(Trajectory(prompt_ids=ids, tools=[], hidden_kwargs={}, generator=None))
            found.versions.append([])
        for row in found.trajectories:
            row.env_error, row.env_name, row.finish = error, REWARD_SOURCE, "env_error"
        return found

    def shutdown(self) -> None:
        self.policy.close()
        shutil.rmtree(self.weights_dir, ignore_errors=True)
