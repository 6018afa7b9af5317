"""Every substitution verl makes into transformers' (and peft's) code, in one place.

On CPU in fp32, verl replaces a few of transformers' forwards with faster ones that compute the same numbers (same
bits, or the same to float rounding: each module's docstring says which and how it was measured). Each entry below
names what it replaces, the architectures it applies to, whether it runs under autograd (training forwards) or only
inside generation, and its off switch. ``apply_cpu_patches`` (called by ``verl.models.loader.load_causal_lm``) applies
them in order; ``verl.models.lora`` applies the LoRA one to peft models.

They are written against transformers' modeling code as of ``TRANSFORMERS_CHECKED`` (pyproject pins the same
range): ``tests/test_patches.py`` runs each (architecture, substitution) pair that is applied against transformers'
own forward on a tiny random config — logits, and gradients where the substitution runs under autograd — so a
transformers upgrade that changes a replaced forward fails there, not in a user's run. The pattern is
Liger-Kernel's (``apply_liger_kernel_to_llama`` and friends): one module, one switch per substitution.

``SCOPED`` lists the substitutions made elsewhere, where they apply: peft's LoRA forward (``verl.models.lora``),
the attention a packed forward switches to (``verl.models.packed_sequences``), and the KV-cache layers the samplers
decode into (``verl.models.kv_cache``, ``verl.models.slot_cache``). ``SUBSTITUTIONS`` is both; each entry names the
test that holds it against transformers' (or peft's) own code, and ``tests/test_patches.py`` fails on a
substitution into their code that no entry lists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from verl.models.attention import use_cpu_attention
from verl.models.fused_decoder import FUSED_LAYER_CLASSES, use_fused_decoder
from verl.models.fused_lora import use_fused_lora
from verl.models.packed_linear import use_packed_linear
from verl.models.packed_sequences import PACKABLE_MODEL_TYPES
from verl.models.rms_norm import RMS_NORM_CLASSES, use_fused_rms_norm
from verl.models.rotary import MODELING_MODULES, use_fused_rotary
from verl.models.swiglu import MLP_CLASSES, use_fused_swiglu

TRANSFORMERS_CHECKED = ">=5.16.1,<5.20"  # the versions tests/test_patches.py ran against; pyproject says the same
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class Patch:
    name: str
    replaces: str  # what of transformers' (or peft's) it stands in for
    architectures: tuple[str, ...]  # model_type values it applies to
    under_autograd: bool  # it runs in training forwards (then its gradients are checked too)
    switch: str  # VAR=0 (or a config key) turns it off
    apply: Callable[[nn.Module], int | bool] | None  # how many modules took it (or whether the model did); None:
    # applied where it is used (SCOPED)
    module: str = ""  # where the substitution is made (default: apply's module)
    checked_by: str = "tests/test_patches.py::test_each_substitution_equals_transformers_forward"

    @property
    def where(self) -> str:
        return self.module or getattr(self.apply, "__module__", "")


def _architectures(class_names: frozenset[str]) -> tuple[str, ...]:
    """``LlamaMLP`` -> ``llama``: the model types of transformers' classes a patch looks for."""
    prefixes = {"Llama": "llama", "Mistral": "mistral", "Qwen2": "qwen2", "Qwen3": "qwen3"}
    return tuple(sorted({model for prefix, model in prefixes.items() for name in class_names
                         if name.startswith(prefix) and not name.startswith(f"{prefix}Moe")}))


PATCHES: tuple[Patch, ...] = (
    Patch("cpu_attention", "config._attn_implementation 'sdpa' -> 'verl_cpu_sdpa' (transformers' AttentionInterface):"
          " grouped K/V without copies, a decode kernel for one query position", LLAMA_FAMILY, True,
          "VERL_CPU_ATTENTION", use_cpu_attention),
    Patch("packed_linear", "nn.Linear.forward by oneDNN-packed weights, inside generation blocks and (frozen weights)"
          " LoRA training's", LLAMA_FAMILY, True, "VERL_PACKED_LINEAR", use_packed_linear),
    Patch("rms_norm", "LlamaRMSNorm.forward (and Mistral's, Qwen2's, Qwen3's): one autograd node",
          _architectures(RMS_NORM_CLASSES), True, "VERL_FUSED_RMS_NORM", use_fused_rms_norm),
    Patch("swiglu", "LlamaMLP.forward's silu(gate) * up: one autograd node", _architectures(MLP_CLASSES), True,
          "VERL_FUSED_SWIGLU", use_fused_swiglu),
    Patch("rotary", "the module-level apply_rotary_pos_emb of each modeling module: one autograd node",
          tuple(MODELING_MODULES), True, "VERL_FUSED_ROTARY", lambda model: use_fused_rotary(),
          module="verl.models.rotary"),
    Patch("decoder_layer", "LlamaDecoderLayer.forward / Qwen2DecoderLayer.forward inside generation: norms, RoPE and "
          "SiLU as four fused calls", _architectures(FUSED_LAYER_CLASSES), False, "VERL_FUSED_DECODER",
          use_fused_decoder),
)
LORA_PATCH = Patch("lora", "peft's LoraLinear.forward: the base product and the rank-r update in one pass",
                   LLAMA_FAMILY, True, "VERL_FUSED_LORA", use_fused_lora,
                   checked_by="tests/test_fused_lora.py::test_output_and_gradients_equal_peft")
SCOPED: tuple[Patch, ...] = (
    LORA_PATCH,
    Patch("packed_attention", "config._attn_implementation -> 'verl_packed' for the duration of a packed forward "
          "(AttentionInterface): the padded forward's key slots gathered per query", tuple(sorted(
              PACKABLE_MODEL_TYPES)), True, "actor_rollout_ref.model.use_remove_padding=False", None,
          module="verl.models.packed_sequences",
          checked_by="tests/test_packed_sequences.py::test_packed_log_probs_and_loss_equal_the_padded_path_bit_for_bit"),
    Patch("growing_cache", "DynamicCache.layers -> GrowingLayer (DynamicLayer.update appending in place)",
          LLAMA_FAMILY, False, "always (a generation cache)", None, module="verl.models.kv_cache",
          checked_by="tests/serve/test_engine_hf.py::test_growing_cache_layer_matches_dynamic_layer_past_its_headroom"),
    Patch("slot_cache", "DynamicCache.layers -> SlotLayer (slot stores the agent loop decodes into)", LLAMA_FAMILY,
          False, "always (a generation cache)", None, module="verl.models.slot_cache",
          checked_by="tests/test_slot_cache.py::test_every_forward_on_slots_is_each_sequences_full_forward"),
)
SUBSTITUTIONS: tuple[Patch, ...] = PATCHES + SCOPED
# Not forwards but imports: ``import verl`` defers transformers' imports of scikit-learn (generation code) and
# scipy.optimize (detection losses) to their first use (verl.utils.deferred_imports; off switch
# VERL_DEFER_IMPORTS=0); tests/test_deferred_imports.py checks transformers still imports through each.


def apply_cpu_patches(model: nn.Module) -> dict[str, int]:
    """Apply every patch in ``PATCHES`` to ``model`` (each a no-op where it does not apply: off CPU, another dtype,
    another architecture, switched off); returns how many modules took each."""
    return {patch.name: int(patch.apply(model)) for patch in PATCHES}
