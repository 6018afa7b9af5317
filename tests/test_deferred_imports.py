"""``import verl`` defers transformers' imports of scikit-learn (generation code) and scipy.optimize (detection
losses) to first use (verl.utils.deferred_imports): a process that loads a model, generates and trains a step imports
neither; the deferred functions return the libraries' numbers; transformers still imports through each deferral
(else it is obsolete: drop it)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from verl.utils import deferred_imports

LOAD_AND_GENERATE = textwrap.dedent("""
    import json, sys
    import torch
    import verl
    from verl.models.loader import load_causal_lm, load_tokenizer, resolve_model_path
    path = resolve_model_path("builtin:tiny-arith-base")
    model, tokenizer = load_causal_lm(path), load_tokenizer(path)
    ids = tokenizer("1+1=", return_tensors="pt").input_ids
    model.generate(ids, max_new_tokens=3, do_sample=False)
    model(input_ids=ids, labels=ids).loss.backward()
    import transformers.generation.candidate_generator as candidate_generator
    import transformers.loss.loss_for_object_detection as detection
    after_generate = sorted({"sklearn", "scipy.optimize"} & set(sys.modules))
    # scipy's own example (linear_sum_assignment's docstring): rows 0, 1, 2 take columns 1, 0, 2 at cost 1 + 2 + 2.
    rows, cols = detection.linear_sum_assignment([[4, 1, 3], [2, 0, 5], [3, 2, 2]])
    # scikit-learn's own example (roc_curve's docstring), by hand: thresholds 0.8, 0.4, 0.35, 0.1 admit
    # the positives (0.8, 0.35) and negatives (0.4, 0.1) in that order.
    fpr, tpr, thresholds = candidate_generator.roc_curve([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8])
    import sklearn.metrics
    print(json.dumps({"after_generate": after_generate, "fpr": fpr.tolist(), "tpr": tpr.tolist(),
                      "thresholds": thresholds[1:].tolist(), "assignment": [rows.tolist(), cols.tolist()],
                      "real_module": hasattr(sklearn.metrics, "precision_score"),
                      "deferred": candidate_generator.roc_curve is not sklearn.metrics.roc_curve}))
""")


def run_python(code: str, **env: str) -> dict:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_loading_generating_and_training_import_neither_and_the_deferred_functions_are_the_libraries():
    pytest.importorskip("sklearn")
    out = run_python(LOAD_AND_GENERATE)
    assert out["after_generate"] == []
    assert out["assignment"] == [[0, 1, 2], [1, 0, 2]]
    assert out["fpr"] == [0.0, 0.0, 0.5, 0.5, 1.0] and out["tpr"] == [0.0, 0.5, 0.5, 1.0, 1.0]
    assert out["thresholds"] == [0.8, 0.4, 0.35, 0.1]
    assert out["deferred"] and out["real_module"]  # the stand-in left sys.modules once transformers had imported


def test_transformers_still_imports_both_without_the_deferral():
    """If this fails, transformers no longer imports them when it loads a model: the deferral is obsolete."""
    pytest.importorskip("sklearn")
    code = ("import json, sys, verl, verl.models.loader; "
            "print(json.dumps(sorted({'sklearn', 'scipy.optimize'} & set(sys.modules))))")
    assert run_python(code, VERL_DEFER_IMPORTS="0") == ["scipy.optimize", "sklearn"]


@pytest.mark.parametrize("importer", sorted(deferred_imports.DEFERRED))
def test_each_importer_still_takes_names_from_the_module_it_defers(importer):
    source = Path(importlib.util.find_spec(importer).origin).read_text()
    assert all(f"from {module} import " in source for module in deferred_imports.DEFERRED[importer])


def test_the_deferral_mechanism_on_a_module_of_our_own(tmp_path, monkeypatch):
    """An importer that takes a function from a slow module: the slow module is imported at the function's first
    call, not with the importer; the importer's source stays readable (tracebacks, inspect)."""
    (tmp_path / "slow_dependency.py").write_text("def double(x):\n    return 2 * x\n")
    (tmp_path / "importer_of_slow.py").write_text("from slow_dependency import double\n\nVALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(deferred_imports.DEFERRED, "importer_of_slow", ("slow_dependency",))
    deferred_imports.install()  # already installed by `import verl`; installing twice keeps one finder
    assert sum(isinstance(f, deferred_imports.DeferringFinder) for f in sys.meta_path) == 1
    try:
        importer = importlib.import_module("importer_of_slow")
        assert importer.VALUE == 7 and "slow_dependency" not in sys.modules
        assert importer.double(21) == 42 and "slow_dependency" in sys.modules
        assert importer.double.__name__ == "double"
        assert "from slow_dependency import double" in inspect.getsource(importer)
    finally:
        for name in ("importer_of_slow", "slow_dependency"):
            sys.modules.pop(name, None)
