"""``trainer.profile_steps``: a profiled step writes a Chrome trace with the step's stages and tables whose numbers
come from the profiler (stage wall times, operators, GEMMs by shape with FLOP counts checked by hand)."""

from __future__ import annotations

import json

import pytest

from tests.test_trainer import tiny_config
from verl.config import build_config
from verl.trainer.local import LocalPPOTrainer
from verl.utils.profiling import matmul_flops

pytestmark = pytest.mark.e2e  # a real process, server, cluster or trainer run: `make test-fast` skips it


def test_profiled_step_writes_trace_and_tables(tmp_path) -> None:
    cfg = tiny_config(tmp_path, trainer={"total_steps": 2, "profile_steps": [2]})
    trainer = LocalPPOTrainer(cfg, quiet=True)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    out = trainer.run_dir / "profile"
    assert sorted(p.name for p in out.iterdir()) == ["step_2.md", "step_2.trace.json"]  # step 1 not profiled
    events = json.loads((out / "step_2.trace.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"stage/gen", "stage/ref", "stage/update_actor", "aten::mm"} <= names
    table = (out / "step_2.md").read_text()
    assert "| update_actor |" in table and "| aten::mm |" in table and "## Matrix products by shape" in table
    timing = [json.loads(line) for line in trainer.config.log_path().read_text().splitlines()]
    profiled = [r for r in timing if r["scope"] == "profile"]
    assert len(profiled) == 1 and profiled[0]["step"] == 2 and profiled[0]["trace"].endswith("step_2.trace.json")


def test_matmul_flops_by_hand() -> None:
    assert matmul_flops("aten::mm", [[16, 576], [576, 1536]]) == 2 * 16 * 576 * 1536
    assert matmul_flops("aten::addmm", [[1536], [16, 576], [576, 1536]]) == 2 * 16 * 576 * 1536
    assert matmul_flops("aten::bmm", [[4, 3, 5], [4, 5, 7]]) == 2 * 4 * 3 * 5 * 7
    # oneDNN's packed linear: input (..., k), packed weight (n, k)
    assert matmul_flops("mkldnn::_linear_pointwise", [[16, 1, 576], [1536, 576]]) == 2 * 16 * 576 * 1536
    assert matmul_flops("aten::mm", [[], []]) is None


def test_verl_null_profile_steps_is_accepted() -> None:
    config = build_config({"trainer": {"profile_steps": None}})
    assert config.trainer.profile_steps == []
