"""New weights for a running transformers engine (vLLM's ``/update_weights``, served as ``serve/weight_updates.py``).

An update names a directory:

- **full weights** (``*.safetensors``, as ``save_pretrained`` writes them, sharded or not): every parameter of the
  model, by its Hugging Face name, copied in place into the served model (a tied weight once, under either name);
  a name the model does not have, a parameter the files do not cover, or another shape is refused before any
  weight is touched, so a bad update leaves the served weights as they were;
- **a LoRA adapter** (``adapter_config.json`` + ``adapter_model.safetensors``, as PEFT saves it): for an adapter
  served by name, its factors are replaced in place (same rank, alpha and target modules, else refused: load it
  under another name); for a full model, the adapter becomes that model's policy (its own requests run base +
  adapter, unmerged; the adapters served over the base still apply to the base alone) — what a LoRA trainer sends
  each step instead of the full weights.

The files are read and checked on the caller's thread (``read_update``); only the in-place copy runs on the engine
thread, between two decode steps (``ServedWeights.update``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import PeftModel
from peft.utils import set_peft_model_state_dict
from safetensors.torch import load_file
from torch import nn
from transformers import PreTrainedModel

from serve.engines.base import EngineError
from verl.models.packed_linear import refresh_packed_linear

BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in a mixed batch
POLICY_ADAPTER = "__policy__"  # a LoRA update of the full model: its requests run base + this adapter
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# What must agree for an adapter's factors to be replaced in place (the modules PEFT built stay as they are).
LORA_SHAPE_KEYS = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "modules_to_save", "bias")


@dataclass
class WeightsUpdate:
    """One directory's weights, read and ready to copy."""

    path: str
    kind: str  # "full" | "lora"
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # HF (full) or PEFT (lora) name -> tensor
    lora_config: dict | None = None  # lora: adapter_config.json


def read_update(path: str) -> WeightsUpdate:
    """The update in directory ``path``; ``EngineError`` (one line: what is wrong, how to fix it) otherwise."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise EngineError(f"update_weights: '{path}' is not a directory (give a safetensors directory as "
                          "save_pretrained writes it, or a PEFT adapter directory)")
    if (directory / ADAPTER_CONFIG).is_file():
        if not (directory / ADAPTER_WEIGHTS).is_file():
            raise EngineError(f"update_weights: '{path}' has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS} (save the "
                              "adapter with PEFT's save_pretrained, safe_serialization=True)")
        return WeightsUpdate(str(directory), "lora", tensors=load_file(str(directory / ADAPTER_WEIGHTS)),
                             lora_config=json.loads((directory / ADAPTER_CONFIG).read_text()))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise EngineError(f"update_weights: no *.safetensors file in '{path}' (a .bin checkpoint or a GGUF file "
                          "cannot be loaded in place: save it with save_pretrained(safe_serialization=True))")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return WeightsUpdate(str(directory), "full", tensors=tensors)


def _target(model: nn.Module, name: str) -> torch.Tensor | None:
    """The parameter or buffer ``name`` of ``model``, also where PEFT moved a wrapped layer's weight under
    ``base_layer`` (a model that serves adapters)."""
    for candidate in (name, ".base_layer.".join(name.rsplit(".", 1))):
        try:
            return model.get_parameter(candidate)
        except AttributeError:
            pass
        try:
            return model.get_buffer(candidate)
        except AttributeError:
            pass
    return None


def apply_full(model: nn.Module, update: WeightsUpdate) -> int:
    """Copy ``update``'s tensors into ``model`` in place (dtype converted to the model's); returns how many
    parameters changed. Everything is checked first: a refusal changes nothing."""
    pairs = fitting_pairs(model, update)
    with torch.no_grad():
        for target, tensor in pairs:
            target.copy_(tensor)
    return len({id(target) for target, _ in pairs})


def fitting_pairs(model: nn.Module, update: WeightsUpdate) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(served tensor, new tensor) for every tensor of ``update``; ``EngineError`` naming what does not fit (names
    the model lacks, other shapes, parameters the files leave out). Reads ``model``, never changes it."""
    pairs = []
    unknown, shapes = [], []
    for name, tensor in update.tensors.items():
        target = _target(model, name)
        if target is None:
            unknown.append(name)
        elif target.shape != tensor.shape:
            shapes.append(f"{name} {tuple(tensor.shape)} (served: {tuple(target.shape)})")
        else:
            pairs.append((target, tensor))
    covered = {id(target) for target, _ in pairs}
    missing = [name for name, p in model.named_parameters() if "lora_" not in name and id(p) not in covered]
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} name(s) the served model does not have (first: {unknown[0]})")
    if shapes:
        problems.append(f"{len(shapes)} shape(s) that differ (first: {shapes[0]})")
    if missing:
        problems.append(f"{len(missing)} parameter(s) the files do not cover (first: {missing[0]})")
    if problems:
        raise EngineError(f"update_weights: '{update.path}' does not fit the served model: " + "; ".join(problems)
                          + " — send the full weights of this architecture (save_pretrained of the same model)")
    return pairs


def lora_shape(config: dict) -> dict:
    """What of an adapter config fixes its modules (``LORA_SHAPE_KEYS``), target modules as a sorted list."""
    shape = {key: config.get(key) for key in LORA_SHAPE_KEYS}
    if isinstance(shape["target_modules"], list | tuple | set):
        shape["target_modules"] = sorted(shape["target_modules"])
    return shape


class ServedWeights:
    """The engine's model, the LoRA adapters over it and the version of each one's weights (engine thread only).

    Adapters served by name are PEFT adapters on the model, unmerged; a LoRA update of the full model adds one more,
    the *policy* (``POLICY_ADAPTER``), that the full model's own requests run with."""

    def __init__(self) -> None:
        self.model: PreTrainedModel | None = None
        self.peft: PeftModel | None = None  # set once an adapter is loaded; wraps self.model
        self.versions: dict[str | None, int] = {}  # weight version: None -> the full model's, else the adapter's
        self.policy_adapter: str | None = None  # the full model's LoRA policy, after a LoRA update of it

    def version_of(self, adapter: str | None) -> int:
        return self.versions.get(adapter, 0)

    def adapter_names(self, requested: list[str | None]) -> list[str]:
        """PEFT's ``adapter_names`` for rows asking for ``requested`` (None: the full model, with its policy)."""
        return [name or self.policy_adapter or BASE_ADAPTER for name in requested]

    @property
    def adapters(self) -> list[str]:
        """The adapters served by name (not the full model's LoRA policy)."""
        names = list(self.peft.peft_config) if self.peft is not None else []
        return [name for name in names if not name.startswith(POLICY_ADAPTER)]

    def load_adapter(self, name: str, path: str) -> None:
        if name in self.adapters:
            raise EngineError(f"an adapter named '{name}' is already loaded")
        if self.peft is None:
            self.peft = PeftModel.from_pretrained(self.model, path, adapter_name=name, is_trainable=False)
        else:
            self.peft.load_adapter(path, adapter_name=name, is_trainable=False)
        self.peft.eval()

    def unload_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise EngineError(f"no adapter named '{name}' is loaded")
        self._drop_adapter(name)
        self.versions.pop(name, None)

    def _drop_adapter(self, name: str) -> None:
        if len(self.peft.peft_config) == 1:
            self.model = self.peft.unload()  # the last one: back to the plain model, no PEFT hooks per forward
            self.peft = None
        else:
            self.peft.delete_adapter(name)

    def check(self, adapter: str | None, update: WeightsUpdate) -> None:
        """``EngineError`` where ``update`` would refuse: full weights for an adapter or that do not fit the model,
        an adapter of another shape than the one it replaces. Changes nothing (a fleet's prepare phase)."""
        self._refuse_other_kind(adapter, update)
        if update.kind == "full":
            fitting_pairs(self.model, update)
        elif adapter is not None:
            self._check_shape(adapter, update)

    def _refuse_other_kind(self, adapter: str | None, update: WeightsUpdate) -> None:
        if update.kind == "full" and adapter is not None:
            raise EngineError(f"update_weights: '{update.path}' holds full weights, and '{adapter}' is a LoRA "
                              "adapter: send an adapter directory, or update its base model")
        if update.kind != "full" and adapter is not None and adapter not in self.adapters:
            raise EngineError(f"no adapter named '{adapter}' is loaded")

    def update(self, adapter: str | None, update: WeightsUpdate, version: int) -> None:
        """Replace the weights of the full model (``adapter`` None) or of a served adapter (engine thread); the fit
        and shape checks run inside ``apply_full`` and ``_replace_factors``, once."""
        self._refuse_other_kind(adapter, update)
        if update.kind == "full":
            apply_full(self.model, update)
            if self.policy_adapter is not None:  # the full weights are the policy now
                self._drop_adapter(self.policy_adapter)
                self.policy_adapter = None
        elif adapter is not None:
            self._replace_factors(adapter, update)
        elif self.policy_adapter is not None and self._same_shape(self.policy_adapter, update):
            self._replace_factors(self.policy_adapter, update)
        else:  # the first LoRA policy, or one of another shape: load it, then let the old one go
            old, self.policy_adapter = self.policy_adapter, f"{POLICY_ADAPTER}{version}"
            if old == self.policy_adapter:
                self.policy_adapter += "-new"
            self.load_adapter(self.policy_adapter, update.path)
            if old is not None:
                self._drop_adapter(old)
        refresh_packed_linear(self.model)  # the packed copies are rebuilt from the new weights at their next use
        self.versions[adapter] = version

    def _same_shape(self, name: str, update: WeightsUpdate) -> bool:
        return lora_shape(self.peft.peft_config[name].to_dict()) == lora_shape(update.lora_config)

    def _check_shape(self, name: str, update: WeightsUpdate) -> None:
        if not self._same_shape(name, update):
            served = lora_shape(self.peft.peft_config[name].to_dict())
            raise EngineError(f"update_weights: the adapter in '{update.path}' has another shape than '{name}' "
                              f"({lora_shape(update.lora_config)} vs {served}); load it under a new name instead")

    def _replace_factors(self, name: str, update: WeightsUpdate) -> None:
        """The adapter's LoRA factors from ``update`` in place (its modules stay: same rank and targets)."""
        self._check_shape(name, update)
        result = set_peft_model_state_dict(self.peft, update.tensors, adapter_name=name)
        if result.unexpected_keys:
            raise EngineError(f"update_weights: '{update.path}' has {len(result.unexpected_keys)} tensor(s) the "
                              f"adapter does not (first: {result.unexpected_keys[0]})")
