"""``import verl`` defers scikit-learn's import inside transformers' generation code to first use
(verl.utils.deferred_imports): a process that loads a model and generates does not import it; the deferred function
returns scikit-learn's numbers; transformers still imports through the deferral (else it is obsolete: drop it)."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
import textwrap

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
    import transformers.generation.candidate_generator as candidate_generator
    after_generate = "sklearn" in sys.modules
    # scikit-learn's own example (roc_curve's docstring), by hand: thresholds 0.8, 0.4, 0.35, 0.1 admit
    # the positives (0.8, 0.35) and negatives (0.4, 0.1) in that order.
    fpr, tpr, thresholds = candidate_generator.roc_curve([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8])
    import sklearn.metrics
    print(json.dumps({"after_generate": after_generate, "fpr": fpr.tolist(), "tpr": tpr.tolist(),
                      "thresholds": thresholds[1:].tolist(),
                      "real_module": hasattr(sklearn.metrics, "precision_score"),
                      "deferred": candidate_generator.roc_curve is not sklearn.metrics.roc_curve}))
""")


def run_python(code: str, **env: str) -> dict:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_loading_a_model_and_generating_imports_no_sklearn_and_the_deferred_roc_curve_is_sklearns():
    pytest.importorskip("sklearn")
    out = run_python(LOAD_AND_GENERATE)
    assert out["after_generate"] is False
    assert out["fpr"] == [0.0, 0.0, 0.5, 0.5, 1.0] and out["tpr"] == [0.0, 0.5, 0.5, 1.0, 1.0]
    assert out["thresholds"] == [0.8, 0.4, 0.35, 0.1]
    assert out["deferred"] and out["real_module"]  # the stand-in left sys.modules once transformers had imported


def test_transformers_still_imports_sklearn_without_the_deferral():
    """If this fails, transformers no longer imports scikit-learn at import time: the deferral is obsolete."""
    pytest.importorskip("sklearn")
    code = ("import json, sys, verl, transformers.generation.candidate_generator; "
            "print(json.dumps({'sklearn': 'sklearn' in sys.modules}))")
    assert run_python(code, VERL_DEFER_IMPORTS="0") == {"sklearn": True}


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
