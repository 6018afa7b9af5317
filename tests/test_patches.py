"""Each substitution of verl/models/patches.py against transformers' own forward, per architecture it applies to
(issue 42): on a tiny random config of each model type, the patched model's logits — and, where the substitution runs
under autograd, the gradients of every weight — equal transformers' unpatched ones. A transformers upgrade that
changes a replaced forward fails here. Generation-only substitutions are checked through a prefill and decode steps
inside the generation blocks that enable them."""

from __future__ import annotations

import contextlib
import copy
import importlib
import re
from pathlib import Path

import pytest
import tomllib
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.decode_utils import left_padded_prompts, prefill_then_decode
from tests.kernels import require_kernels
from verl.models.fused_decoder import fused_decoder_layers
from verl.models.packed_linear import packed_weights
from verl.models.patches import LLAMA_FAMILY, PATCHES, SCOPED, SUBSTITUTIONS, TRANSFORMERS_CHECKED
from verl.models.rotary import _ORIGINALS, MODELING_MODULES, fused_apply_rotary_pos_emb

REPO = Path(__file__).resolve().parents[1]
PAIRS = [(patch, arch) for patch in PATCHES for arch in patch.architectures]


def tiny(arch: str) -> torch.nn.Module:
    """A 2-layer random model of ``arch`` (grouped-query attention, SiLU MLP), fp32, sdpa attention."""
    config = AutoConfig.for_model(arch, vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                                  tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.fixture
def transformers_rotary(monkeypatch):
    """Transformers' own apply_rotary_pos_emb in every modeling module while the test runs (the rotary patch is
    module-wide once a model was loaded in this process); the test swaps the fused one in where it wants it."""
    for name in MODELING_MODULES:
        if name in _ORIGINALS:
            module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
            monkeypatch.setattr(module, "apply_rotary_pos_emb", _ORIGINALS[name])


def training_pass(model: torch.nn.Module, packed: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and every gradient of one loss; ``packed``: frozen linear layers, inside LoRA training's packed block
    (the input gradients then flow through the packed transposes)."""
    ids, mask = left_padded_prompts(rows=3, length=9)
    if packed:
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.requires_grad_(False)
    model.zero_grad(set_to_none=True)
    with packed_weights(gradients=True) if packed else contextlib.nullcontext():
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def generation_pass(model: torch.nn.Module) -> torch.Tensor:
    """A prefill and decode steps inside a rollout's blocks (packed weights, fused decoder layers)."""
    ids, mask = left_padded_prompts(rows=3, length=9)
    with torch.inference_mode(), packed_weights(trainable=True), fused_decoder_layers():
        return prefill_then_decode(model, ids, mask)


@pytest.mark.parametrize(("patch", "arch"), PAIRS, ids=[f"{p.name}-{a}" for p, a in PAIRS])
def test_each_substitution_equals_transformers_forward(patch, arch, transformers_rotary, monkeypatch):
    if patch.name in ("cpu_attention", "decoder_layer", "rms_norm", "swiglu", "rotary"):
        require_kernels()  # their fast paths are the kernels; without them they run transformers' code
    reference = tiny(arch)
    patched = copy.deepcopy(reference)
    packed = patch.name == "packed_linear"
    want = training_pass(reference, packed) if patch.under_autograd else None
    want_generated = generation_pass(reference)
    if patch.name == "rotary":  # module-wide: swapped in after the reference ran
        monkeypatch.setattr(importlib.import_module(f"transformers.models.{arch}.modeling_{arch}"),
                            "apply_rotary_pos_emb", fused_apply_rotary_pos_emb)
    else:
        assert patch.apply(patched), f"{patch.name} did not apply to {arch}"
    if want is not None:
        logits, grads = training_pass(patched, packed)
        torch.testing.assert_close(logits, want[0], rtol=1e-5, atol=1e-5)
        assert grads.keys() == want[1].keys() and grads
        for name, grad in want[1].items():
            scale = float(grad.abs().max()) or 1.0
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)
    torch.testing.assert_close(generation_pass(patched), want_generated, rtol=1e-5, atol=1e-5)


def test_every_patch_is_listed_with_its_switch_and_pyproject_pins_the_checked_range():
    assert {p.name for p in PATCHES} == {"cpu_attention", "packed_linear", "rms_norm", "swiglu", "rotary",
                                         "decoder_layer"}
    assert all(p.switch.startswith("VERL_") and p.architectures for p in PATCHES)
    assert set(LLAMA_FAMILY) == {"llama", "mistral", "qwen2", "qwen3"}
    # The rotary node covers four architectures, the fused decoder layer two (as the issue lists them).
    by_name = {p.name: p.architectures for p in PATCHES}
    assert by_name["rotary"] == ("llama", "mistral", "qwen2", "qwen3") and by_name["decoder_layer"] == ("llama",
                                                                                                         "qwen2")
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"transformers{TRANSFORMERS_CHECKED}" in dependencies


# Lines that substitute into transformers' or peft's code: a forward replaced on a module, an attention function
# registered or switched to, a cache's layers swapped, a modeling module's function replaced.
SUBSTITUTION_SITE = re.compile(r"\.forward = types\.MethodType|AttentionInterface\.register\(|_attn_implementation = "
                               r"|\.layers = \[|module\.apply_rotary_pos_emb = ")


def test_every_substitution_in_the_code_is_listed_with_a_drift_test_that_exists():
    """A scan of verl/ and serve/ for substitution sites: each lies in the module of a listed entry (PATCHES, which
    loading applies, or SCOPED, applied where used), and each entry's ``checked_by`` names a test that exists."""
    assert {p.name for p in SCOPED} == {"lora", "packed_attention", "growing_cache", "slot_cache"}
    sites: dict[str, list[int]] = {}
    for root in ("verl", "serve"):
        for path in sorted((REPO / root).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if SUBSTITUTION_SITE.search(line) and not line.lstrip().startswith("#"):
                    sites.setdefault(".".join(path.relative_to(REPO).with_suffix("").parts), []).append(number)
    listed = {p.where for p in SUBSTITUTIONS}
    assert len(sites) >= 9, sites  # the scan finds the sites it looks for
    assert set(sites) <= listed, {module: lines for module, lines in sites.items() if module not in listed}
    for patch in SUBSTITUTIONS:
        file, test = patch.checked_by.split("::")
        assert re.search(rf"^def {test}\(", (REPO / file).read_text(), re.M), (patch.name, patch.checked_by)
