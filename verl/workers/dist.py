"""Data parallelism for the actor and critic: a ``torch.distributed`` group, exact gradient sums, FSDP.

Losses are normalised by *global* counts (tokens / sequences of the whole mini-batch), so each rank's loss is
a partial sum of the single-process loss. Summing gradients over ranks (all-reduce SUM, or FSDP's reduce-scatter
with divide factor 1) therefore gives exactly the single-process gradient, and every rank takes the same step.

Backends: gloo on CPU, NCCL on GPU. ``world_size == 1`` makes everything here a no-op, so the same role code
runs in the local executor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl.models.packed_linear import remove_packed_linear
from verl.protocol import DataProto


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    fsdp: bool = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def loss_scale(self) -> float:
        """Multiplier on local losses so FSDP's gradient *average* over ranks equals the gradient *sum*."""
        return float(self.world_size) if self.fsdp else 1.0


def open_rendezvous(host: str = "127.0.0.1") -> dist.TCPStore:
    """The rendezvous store of one process group, hosted by the caller (the Ray driver, or the only rank).

    It binds a port the OS picks at once and holds it for the store's lifetime. A port chosen with
    ``free_port()`` and bound seconds later by rank 0 (after its process started and imported torch) could be
    taken in between by any other connection on a busy machine — the store closes that gap. Keep the returned
    object alive while the group runs: it is the server."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device) -> None:
    """Join the role's process group through the store at ``master_addr:master_port`` (see ``open_rendezvous``).

    ``master_port=0`` is for a group of one (FSDP in a single process): it hosts its own store."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if master_port == 0:
        if world_size != 1:
            raise ValueError(f"a process group of {world_size} ranks needs the port of a store every rank can "
                             "reach (open_rendezvous); 0 only serves a group of one")
        store = open_rendezvous(master_addr)
    else:
        store = dist.TCPStore(master_addr, master_port, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def local_shard(data: DataProto, info: DistInfo, group_size: int = 1) -> DataProto:
    """This rank's contiguous share of ``data``; shares hold whole groups so shared-prefix passes still apply."""
    if not info.enabled:
        return data
    if len(data) % info.world_size:
        raise ValueError(f"cannot shard {len(data)} rows evenly over {info.world_size} data-parallel ranks")
    return data.chunk(info.world_size)[info.rank]


def all_reduce_gradients(parameters: list[torch.nn.Parameter], info: DistInfo) -> None:
    """Sum gradients over ranks (one flat buffer: one collective instead of one per tensor)."""
    if not info.enabled or info.fsdp:
        return  # FSDP reduces gradients inside backward
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _collective_device() -> torch.device:
    """NCCL reduces only CUDA tensors; gloo only CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sums(values: dict[str, float], info: DistInfo) -> dict[str, float]:
    """Sum scalar metric partials over ranks (keys in sorted order so every rank packs the same vector)."""
    return _all_reduce_scalars(values, info, dist.ReduceOp.SUM)


def all_reduce_maxima(values: dict[str, float], info: DistInfo) -> dict[str, float]:
    """The largest of each scalar over ranks (a minimum travels as a negated maximum)."""
    return _all_reduce_scalars(values, info, dist.ReduceOp.MAX)


def _all_reduce_scalars(values: dict[str, float], info: DistInfo, op: Any) -> dict[str, float]:
    if not info.enabled:
        return values
    keys = sorted(values)
    packed = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(packed, op=op)
    return dict(zip(keys, packed.tolist(), strict=True))


def _reduce_flag(flag: bool, info: DistInfo, op: Any) -> bool:
    if not info.enabled:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=_collective_device())
    dist.all_reduce(value, op=op)
    return bool(value.item() > 0)


def all_ranks(flag: bool, info: DistInfo) -> bool:
    return _reduce_flag(flag, info, dist.ReduceOp.MIN)


def apply_fsdp(model: torch.nn.Module, info: DistInfo, device: torch.device, offload: bool = False) -> torch.nn.Module:
    """Shard ``model`` with FSDP2 (``fully_shard``): each decoder layer, then the root.

    FSDP averages gradients over ranks; losses are scaled by ``DistInfo.loss_scale`` (the world size) to turn
    that average back into the sum the global-count normalisation needs. (A divide factor of 1 would say the
    same more directly, but it needs PREMUL_SUM, which gloo lacks.)
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    remove_packed_linear(model)  # sharded weights are gathered anew at every forward: nothing to keep packed
    mesh = init_device_mesh(device.type, (info.world_size,))
    kwargs = {"mesh": mesh}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:  # peft wraps the HF model one level deeper
        base = getattr(model, "base_model", None)
        layers = getattr(getattr(getattr(base, "model", None), "model", None), "layers", None)
    for layer in layers or []:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def full_state_dict(model: torch.nn.Module, info: DistInfo) -> dict[str, torch.Tensor]:
    """The unsharded CPU state dict (collective under FSDP: every rank must call it)."""
    if not info.fsdp:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def grad_norm_value(norm: torch.Tensor) -> float:
    """A float from ``clip_grad_norm_``'s result (a DTensor under FSDP)."""
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
