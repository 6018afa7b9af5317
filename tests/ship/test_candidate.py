"""Which candidate ``verl ship`` canaries: one it loads, or one the service already serves under its name."""

from __future__ import annotations

import pytest

from eval.ship.run import already_served
from serve.lineage import weights_hash
from verl.errors import ConfigError


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "checkpoints" / "global_step_3"
    path.mkdir(parents=True)
    (path / "adapter_model.safetensors").write_bytes(b"adapter weights")
    return path


def test_a_served_adapter_with_the_checkpoints_weights_is_shipped_as_loaded(ckpt):
    assert already_served(None, ckpt, 0.0) is False  # not served: ship loads it
    assert already_served({"name": "live", "weights": weights_hash(ckpt)}, ckpt, 0.0) is True


def test_a_served_name_with_other_weights_or_a_share_is_refused(ckpt):
    with pytest.raises(ConfigError, match=r"already serves a model named 'live' with other weights \(sha256 "
                                          r"0123456789abcdef, the checkpoint's [0-9a-f]{16}\); pass --name"):
        already_served({"name": "live", "weights": "0123456789abcdef"}, ckpt, 0.0)
    with pytest.raises(ConfigError, match=r"'live' already has 25% of the route; a canary starts from 0%"):
        already_served({"name": "live", "weights": weights_hash(ckpt)}, ckpt, 0.25)
