"""The README's first command installs what running needs and nothing test-only; the second adds the rest."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
TEST_ONLY = ("pytest", "ruff", "schemathesis", "playwright", "lm-eval", "openai", "ray")


def _extra(extras: dict[str, list[str]], name: str) -> set[str]:
    """The requirement names an extra pulls in, following verl-suite[...] self-references."""
    names: set[str] = set()
    for requirement in extras[name]:
        own = re.match(r"verl-suite\[(.+)\]", requirement)
        if own:
            for part in own.group(1).split(","):
                names |= _extra(extras, part.strip())
        else:
            names.add(re.split(r"[<>=!;\[ ]", requirement, maxsplit=1)[0].lower())
    return names


def test_make_train_installs_the_run_extra_without_test_only_packages():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    run = _extra(extras, "run")
    assert {"tensorboard", "wandb", "mlflow", "matplotlib", "fastapi", "uvicorn", "locust"} <= run
    assert not run & set(TEST_ONLY), run & set(TEST_ONLY)
    assert set(TEST_ONLY) <= _extra(extras, "dev") and run <= _extra(extras, "dev")
    makefile = (ROOT / "Makefile").read_text()
    first_install = makefile[makefile.index("$(STAMP): pyproject.toml"):makefile.index("$(DEV_STAMP): $(STAMP)")]
    assert '-e ".[run]"' in first_install and ".[dev]" not in first_install
    # make test: the dev extra, then the CPU kernels' one-time build (`make kernels`, which needs only `install`)
    assert re.search(r"^train: install$", makefile, re.M) and re.search(r"^test: install-dev kernels$", makefile, re.M)
    assert re.search(r"^kernels: install$", makefile, re.M)
