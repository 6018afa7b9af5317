"""``RayPPOTrainer``: the same driver loop, with ``RayRoles`` over Ray worker groups (``trainer.executor=ray``).

Placement (``trainer.ray.placement``), as HybridFlow's resource pools:

- ``colocate`` (default): ``trainer.n_workers`` processes each hold actor + rollout, reference and critic;
  the reward runs in the driver. Fewest processes and copies.
- ``split``: an actor/rollout group (``n_workers``), a critic group (``n_workers``, PPO only), a reference
  group (``ray.ref_workers``) and one reward worker, each a separate process.

Actor and critic groups are data-parallel: every call's batch is split into equal contiguous shares (whole
prompt groups), and the update's gradients are summed over ranks with ``torch.distributed`` (gloo on CPU,
NCCL on GPU), or sharded with FSDP (``actor.strategy=fsdp``). Losses use global counts, so the step equals
the single-process one; rollouts are seeded per prompt, so they do not depend on how prompts are split — the
first-step loss matches ``LocalPPOTrainer`` from the same seed (tested).

A dead or failing worker raises a ``VerlError`` naming the role and rank; checkpoints are written atomically,
so the last complete one stays intact for ``trainer.resume=auto``.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verl.config import VerlConfig
from verl.data.dataset import RLHFDataset
from verl.errors import ConfigError, MissingDependencyError, VerlError
from verl.protocol import DataProto, pad_responses
from verl.rollout.base import SamplingParams
from verl.trainer.checkpoint import read_pointer
from verl.trainer.overlap import RayRolloutWorker
from verl.trainer.ppo import PPOTrainer, prepare_inputs
from verl.utils.net import LOOPBACK
from verl.workers.dist import open_rendezvous
from verl.workers.reward import RewardManager
from verl.workers.role_worker import RoleWorker, needed_roles


def _import_ray():
    try:
        import ray
    except ImportError:
        raise MissingDependencyError("ray", "trainer.executor=ray", "pip install -e '.[ray]'") from None
    return ray


def actor_death_cause(exc: Exception) -> str:
    """One line on why a Ray actor died. A failed constructor's exception is the message's last line (Ray puts
    the remote traceback between it and the first line, which only says the creation task failed)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(exc).splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return type(exc).__name__
    if len(lines) > 1 and "creation task" in lines[0]:
        return f"its constructor raised {lines[-1]}"
    return lines[0]


class WorkerGroup:
    """Ray actors running ``RoleWorker`` for one role set; ranks 0..n-1."""

    def __init__(self, ray, name: str, config: dict, roles: list[str], size: int, num_cpus: float,
                 num_gpus: float, timeout: float, distributed: bool):
        self.ray, self.name, self.timeout = ray, name, timeout
        # The driver hosts the group's rendezvous store: its port is bound before any rank starts, so nothing
        # else on the machine can take it while the ranks' processes start up (held for the group's lifetime).
        self.store = open_rendezvous(LOOPBACK) if distributed and size > 1 else None
        port = self.store.port if self.store is not None else 0
        remote = ray.remote(RoleWorker).options(num_cpus=num_cpus, num_gpus=num_gpus)
        self.workers = [
            remote.remote(config, roles, rank, size if distributed else 1, LOOPBACK, port) for rank in range(size)
        ]

    def __len__(self) -> int:
        return len(self.workers)

    def get(self, refs: list, method: str) -> list:
        """Wait for every rank; a failure names the group, the rank and the cause."""
        out = []
        for rank, ref in enumerate(refs):
            try:
                out.append(self.ray.get(ref, timeout=self.timeout))
            except self.ray.exceptions.GetTimeoutError:
                raise VerlError(f"Ray worker '{self.name}' rank {rank} did not finish {method} within "
                                f"{self.timeout:.0f} s (trainer.ray.timeout_s)") from None
            except self.ray.exceptions.RayActorError as exc:
                raise VerlError(f"Ray worker '{self.name}' rank {rank} died during {method}: "
                                f"{actor_death_cause(exc)}") from None
            except self.ray.exceptions.RayTaskError as exc:
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                raise VerlError(f"Ray worker '{self.name}' rank {rank} failed in {method}: "
                                f"{type(cause).__name__}: {cause}") from None
        return out

    def call_all(self, method: str, *args: Any) -> list:
        """Every rank runs ``method(*args)`` (large args are shared through the object store once)."""
        shared = [self.ray.put(a) if isinstance(a, DataProto) else a for a in args]
        return self.get([getattr(w, method).remote(*shared) for w in self.workers], method)

    def call_split(self, method: str, data: DataProto, *args: Any) -> list:
        """Rank r runs ``method(share_r, *args)`` on its contiguous share of ``data``."""
        shares = data.chunk(len(self.workers)) if len(self.workers) > 1 else [data]
        return self.get([getattr(w, method).remote(s, *args) for w, s in zip(self.workers, shares, strict=True)],
                        method)

    def call_split_padded(self, method: str, data: DataProto, *args: Any) -> tuple[list, int]:
        """``call_split`` for any batch size: the last row is repeated until every rank gets an equal share
        (sharded models need every rank in every forward). Returns the parts and how many rows were added."""
        extra = -len(data) % len(self.workers)
        if extra:
            data = DataProto.concat([data, data.index([len(data) - 1] * extra)])
        return self.call_split(method, data, *args), extra


class RayRoles:
    """The roles over Ray worker groups: the ``Roles`` the loop calls, each operation split over (or sent to) the
    group that holds the role."""

    def __init__(self, config: VerlConfig, tokenizer: Any, reward_manager: RewardManager):
        ray = _import_ray()
        self.config, self.tokenizer, self.reward_manager = config, tokenizer, reward_manager
        self._start_ray(ray)
        self._check_resources(ray)
        self.groups = self._create_groups(ray)
        for group in self.groups.values():
            group.call_all("ping")  # surface construction errors now, naming the group

    # ------------------------------------------------------------------ setup

    def _start_ray(self, ray) -> None:
        cfg = self.config.trainer
        # Without this Ray 2.60 writes an auth token under ~/.ray and expects it on every connection.
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        self._owns_ray = not ray.is_initialized()
        if not self._owns_ray:
            return
        env = {k: v for k, v in os.environ.items() if k.startswith(("VERL_", "HF_", "TOKENIZERS_", "OMP_"))}
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True, "runtime_env": {"env_vars": env}}
        if cfg.ray.address:
            ray.init(address=cfg.ray.address, **kwargs)
        else:
            needed = self._process_count() * cfg.ray.num_cpus_per_worker
            ray.init(num_cpus=max(1, int(np.ceil(needed))), **kwargs)

    def _check_resources(self, ray) -> None:
        """Fail now, not after a timeout, when the placement asks for more than the cluster has."""
        rc = self.config.trainer.ray
        need_cpu = self._process_count() * rc.num_cpus_per_worker
        have = ray.available_resources()
        if have.get("CPU", 0.0) + 1e-9 < need_cpu:
            raise VerlError(
                f"trainer.ray.placement={rc.placement} needs {need_cpu:g} CPUs for {self._process_count()} worker "
                f"processes but the Ray cluster has {have.get('CPU', 0.0):g} free; lower "
                f"trainer.ray.num_cpus_per_worker (fractions are fine) or use placement=colocate"
            )
        gpu_workers = self.config.trainer.n_workers * (1 if rc.placement == "colocate" else
                                                       (2 if self.config.use_critic else 1) + rc.ref_workers)
        need_gpu = gpu_workers * rc.num_gpus_per_worker
        if need_gpu and have.get("GPU", 0.0) + 1e-9 < need_gpu:
            raise VerlError(f"the placement needs {need_gpu:g} GPUs but the Ray cluster has {have.get('GPU', 0.0):g} "
                            "free; lower trainer.n_workers or trainer.ray.num_gpus_per_worker")

    def _process_count(self) -> int:
        cfg = self.config
        rollout = 1 if cfg.trainer.one_step_off_policy else 0  # the overlapped rollout's own actor
        if cfg.trainer.ray.placement == "colocate":
            return cfg.trainer.n_workers + rollout
        return cfg.trainer.n_workers * (2 if cfg.use_critic else 1) + cfg.trainer.ray.ref_workers + 1 + rollout

    def _group(self, ray, name: str, roles: list[str], size: int = 1, distributed: bool = False,
               num_gpus: float | None = None) -> WorkerGroup:
        """A WorkerGroup of ``size`` actors holding ``roles``, sized by ``trainer.ray`` (CPUs, GPUs, timeout)."""
        rc = self.config.trainer.ray
        return WorkerGroup(ray, name, self.config.model_dump(mode="json"), roles, size,
                           num_cpus=rc.num_cpus_per_worker, timeout=rc.timeout_s, distributed=distributed,
                           num_gpus=rc.num_gpus_per_worker if num_gpus is None else num_gpus)

    def _create_groups(self, ray) -> dict[str, WorkerGroup]:
        cfg = self.config
        n = cfg.trainer.n_workers
        if cfg.trainer.ray.placement == "colocate":
            roles = [r for r in needed_roles(cfg) if r != "reward"]
            group = self._group(ray, "actor_rollout_ref" + ("_critic" if cfg.use_critic else ""), roles, n, True)
            return {"actor": group, **({"ref": group} if cfg.use_reference else {}),
                    **({"critic": group} if cfg.use_critic else {})}
        groups = {"actor": self._group(ray, "actor_rollout", ["actor"], n, True)}
        if cfg.use_reference:
            groups["ref"] = self._group(ray, "reference", ["ref"], cfg.trainer.ray.ref_workers)
        if cfg.use_critic:
            groups["critic"] = self._group(ray, "critic", ["critic"], n, True)
        groups["reward"] = self._group(ray, "reward", ["reward"], num_gpus=0.0)
        return groups

    # ------------------------------------------------------------------ role operations

    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        # e.g. a validation tail: the last prompt is repeated so every rank gets an equal share
        parts, extra = self.groups["actor"].call_split_padded("generate", prompts, params)
        out = DataProto.concat(pad_responses(parts, self.tokenizer.pad_token_id))
        return out.index(slice(0, len(out) - extra * params.n)) if extra else out

    def compute_reward(self, batch: DataProto) -> tuple[torch.Tensor, dict[str, np.ndarray], list[str]]:
        if "reward" in self.groups:
            return self.groups["reward"].call_all("compute_reward", batch)[0]
        return self.reward_manager.compute(batch)

    def _split_cat(self, role: str, method: str, batch: DataProto) -> torch.Tensor:
        return torch.cat(self.groups[role].call_split(method, batch))

    def compute_old_log_prob(self, batch: DataProto) -> torch.Tensor:
        return self._split_cat("actor", "compute_old_log_prob", batch)

    def compute_ref_log_prob(self, batch: DataProto) -> torch.Tensor:
        return self._split_cat("ref", "compute_ref_log_prob", batch)

    def compute_values(self, batch: DataProto) -> torch.Tensor:
        return self._split_cat("critic", "compute_values", batch)

    def compute_kl_terms(self, batch: DataProto) -> dict[str, torch.Tensor]:
        if self.groups.get("ref") is not self.groups["actor"]:
            raise ConfigError("trainer.evaluators: 'kl' in validation needs the reference in the actor's workers "
                              "(trainer.ray.placement=colocate); with a split placement run `verl eval "
                              "--evaluators kl` on the checkpoints")
        parts, _ = self.groups["actor"].call_split_padded("compute_kl_terms", batch)
        return {key: torch.cat([p[key] for p in parts])[: len(batch)] for key in parts[0]}

    def update_actor(self, batch: DataProto, mini_batch_size: int) -> dict[str, float]:
        # Every rank gets the whole batch and takes its own share of each mini-batch (global loss counts).
        return self.groups["actor"].call_all("update_actor", batch, mini_batch_size)[0]

    def update_critic(self, batch: DataProto, mini_batch_size: int) -> dict[str, float]:
        return self.groups["critic"].call_all("update_critic", batch, mini_batch_size)[0]

    def validation_engine(self):
        return self  # generate() above has the engine signature

    def start_rollout_worker(self) -> RayRolloutWorker:
        """trainer.one_step_off_policy: one more Ray actor generating ahead; weights from actor rank 0."""
        ray = _import_ray()
        worker = RayRolloutWorker(ray, self.config, self.groups["actor"].workers[0],
                                  lambda name, roles: self._group(ray, name, roles))
        worker.group.call_all("ping")  # construction errors now, naming the group
        return worker

    # ------------------------------------------------------------------ checkpoints

    def _stateful_groups(self) -> list[WorkerGroup]:
        """Each group that holds trained state (actor, critic) once, though colocation maps several roles to it."""
        unique = {id(g): g for g in self.groups.values()}
        return [g for g in unique.values() if g.name not in ("reference", "reward")]

    def save(self, directory: str | Path) -> None:
        for group in self._stateful_groups():
            group.call_all("save", str(directory))

    def load(self, directory: str | Path) -> None:
        for group in self._stateful_groups():
            group.call_all("load", str(directory))

    def shutdown(self) -> None:
        ray = _import_ray()
        for group in {id(g): g for g in self.groups.values()}.values():
            for worker in group.workers:
                with contextlib.suppress(Exception):  # a dead worker has nothing left to shut down
                    ray.get(worker.shutdown.remote(), timeout=30)
                ray.kill(worker)
        if self._owns_ray:
            ray.shutdown()


class RayPPOTrainer(PPOTrainer):
    """``PPOTrainer`` with ``RayRoles``; only construction (and a failure message) differ from the local one."""

    def __init__(self, config: VerlConfig, train_dataset: RLHFDataset | None = None,
                 val_dataset: RLHFDataset | None = None, quiet: bool = False):
        inputs = prepare_inputs(config, None, train_dataset, val_dataset)
        reward_manager = RewardManager(inputs.tokenizer, config.reward)  # validation (and colocated) scoring
        roles = RayRoles(config, inputs.tokenizer, reward_manager)
        super().__init__(config, roles, inputs, reward_manager, device=torch.device("cpu"), quiet=quiet,
                         rollout_worker_factory=roles.start_rollout_worker)

    @property
    def groups(self) -> dict[str, WorkerGroup]:
        return self.roles.groups

    def fit(self) -> dict[str, float]:
        try:
            return super().fit()
        except VerlError as exc:  # a worker failure: say which checkpoint a resume would continue from
            latest = read_pointer(self.run_dir)
            where = f"; last complete checkpoint: {latest}" if latest else "; no checkpoint was written yet"
            raise VerlError(f"{exc}{where}") from None
