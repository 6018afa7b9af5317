"""``python3 -m verl.trainer.main_ppo key=value ...``: verl's launch line, run as ``verl train`` runs it.

verl users start training with this module and Hydra overrides; the keys are mapped onto ours by
``verl.config_aliases`` exactly as for ``verl train`` (renamed keys and ignored GPU-only keys are listed once). Hydra's
``--config-path DIR --config-name NAME`` (or ``--config-path=DIR``) become ``--config DIR/NAME.yaml``; every other
argument, ``--dry-run`` included, goes to ``verl train`` unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path

from verl.trainer.cli import train_app


def hydra_to_train_args(argv: list[str]) -> list[str]:
    """``verl train``'s arguments for a ``main_ppo`` command line (Hydra's config flags turned into ``--config``)."""
    args, config_path, config_name = [], None, None
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, value = arg.partition("=")
        if flag in ("--config-path", "--config-name", "-cp", "-cn"):
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(f"error: {flag} needs a value (e.g. {flag} ppo_trainer)")
                i, value = i + 1, argv[i + 1]
            if flag in ("--config-path", "-cp"):
                config_path = value
            else:
                config_name = value
        else:
            args.append(arg)
        i += 1
    if config_name is not None:
        name = config_name if config_name.endswith((".yaml", ".yml")) else f"{config_name}.yaml"
        args = ["--config", str(Path(config_path or ".") / name), *args]
    elif config_path is not None:
        raise SystemExit("error: --config-path without --config-name: name the YAML file in it (--config-name X)")
    return args


def main(argv: list[str] | None = None) -> None:
    prog = "python -m verl.trainer.main_ppo"
    train_app(prog)(hydra_to_train_args(list(sys.argv[1:] if argv is None else argv)), prog_name=prog)


if __name__ == "__main__":
    main()
