"""`verl check-env` / check_env(): a line per requirement with its fix; exit 0 only when required parts are fine."""

from __future__ import annotations

from tests.trainer_utils import run_cli
from verl.utils import env_check


def test_this_environment_passes(capsys):
    assert env_check.check_env() is True
    out = capsys.readouterr().out
    assert "[✓] Python" in out and "[✓] PyTorch: 2." in out and "[✓] transformers" in out
    assert out.strip().endswith("environment OK")


def test_missing_required_package_fails_with_the_install_command(monkeypatch, capsys):
    real = env_check._version
    monkeypatch.setattr(env_check, "_version", lambda dist: None if dist == "transformers" else real(dist))
    assert env_check.check_env() is False
    out = capsys.readouterr().out
    assert '[✗] transformers: not installed → pip install "transformers>=5.16.1,<5.20"' in out


def test_wrong_version_and_missing_optional_package(monkeypatch, capsys):
    real = env_check._version
    fake = {"pyarrow": "9.0.0", "wandb": None}
    monkeypatch.setattr(env_check, "_version", lambda dist: fake[dist] if dist in fake else real(dist))
    assert env_check.check_env() is False  # pyarrow is required
    out = capsys.readouterr().out
    assert "[✗] pyarrow: 9.0.0 does not satisfy >=15" in out
    # optional parts only warn, with the extra that installs them
    assert "[!] wandb: not installed (optional: wandb tracking) → pip install -e '.[tracking]'" in out


def test_only_optional_gaps_still_pass(monkeypatch):
    real = env_check._version
    monkeypatch.setattr(env_check, "_version", lambda dist: None if dist in ("ray", "mlflow", "locust") else real(dist))
    assert env_check.check_env(print_report=False) is True


def test_cli_exit_code():
    result = run_cli(["check-env"])
    assert result.returncode == 0 and "environment OK" in result.stdout


def test_build_kernels_ahead_then_the_line_says_built():
    """``verl check-env --build-kernels`` builds (or finds) the kernels in the shared cache; its line says where."""
    from tests.kernels import require_kernels

    require_kernels()  # skipped, with the allowed reason, where no compiler is here or the kernels are off
    result = run_cli(["check-env", "--build-kernels"])
    line = next(line for line in result.stdout.splitlines() if "CPU kernels" in line)
    assert result.returncode == 0 and line.startswith("[✓] CPU kernels: built (") and "torch_extensions" in line, \
        result.stdout
