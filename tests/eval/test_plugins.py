"""Evaluator specs and resolution: built-ins, registration, entry points, file.py:Class, module:Class,
plain-dict plugins, and validation during training."""

from __future__ import annotations

import numpy as np
import pytest

from tests.eval.helpers import make_batch
from verl.errors import ConfigError
from verl.evaluators import available_evaluators, build_evaluator, build_evaluators, registry
from verl.trainer import validation

USER_EVALUATOR = '''
import numpy as np
from verl.evaluators import EvalResult, Evaluator


class ShortAnswers(Evaluator):
    name = "short"
    needs = frozenset({"generations"})

    def __init__(self, limit=3):
        self.limit = limit
        self.options = {"limit": limit}

    def evaluate(self, batch):
        column = np.array([len(r) <= self.limit for r in batch.responses], dtype=float)
        return EvalResult(metrics={"short_ratio": self.mean("short_ratio", column, batch, binary=True)},
                          per_sample={"short": column})


def plain(batch):
    return {"count": len(batch)}
'''


def test_parse_and_split_specs():
    assert registry.split_specs("accuracy, diversity(ngrams=1,2), length") == [
        "accuracy", "diversity(ngrams=1,2)", "length"]
    assert registry.parse_spec("diversity(ngrams=1;2;3, tokenize=chars)") == (
        "diversity", {"ngrams": [1, 2, 3], "tokenize": "chars"})
    assert registry.parse_spec("diversity(ngrams=1,2, tokenize=chars)")[1]["ngrams"] == [1, 2]
    assert registry.parse_spec("a/b.py:C(x=0.5)") == ("a/b.py:C", {"x": 0.5})
    with pytest.raises(ConfigError, match="not key=value"):
        registry.parse_spec("diversity(ngrams)")


def test_builtins_resolve_from_the_one_registry_without_entry_points(monkeypatch):
    # A plain checkout on PYTHONPATH has no entry-point metadata: every built-in still resolves.
    monkeypatch.setattr(registry.EVALUATORS, "entry_points", dict)
    names = registry.builtin_names()
    assert names == ["reward", "kl", "diversity", "accuracy", "length", "tools"]
    assert set(available_evaluators()) == set(names) | {"judge", "mismatch", "code"}  # shipped, run when named
    evaluator = build_evaluator("length(percentiles=50)")
    assert type(evaluator).__module__ == "verl.evaluators.length" and evaluator.percentiles == [50.0]


def test_a_registered_name_is_never_silently_replaced(monkeypatch):
    class Mine:
        name = "mine"

        def evaluate(self, batch):
            return {"mine": 1.0}

    monkeypatch.setattr(registry, "EVALUATORS", registry.EVALUATORS.copy())
    registry.register_evaluator("mine")(Mine)
    assert type(build_evaluator("mine")) is Mine
    with pytest.raises(ValueError, match="evaluator 'accuracy' is defined twice: verl.evaluators.accuracy:Accuracy "
                                         "and tests.eval.test_plugins:.*Mine"):
        registry.register_evaluator("accuracy")(Mine)
    # Another package declaring a built-in's name as an entry point is named, not preferred or ignored.
    point = __import__("importlib.metadata").metadata.EntryPoint("accuracy", "their_pkg:Acc", "verl.evaluators")
    monkeypatch.setattr(registry.EVALUATORS, "entry_points", lambda: {"accuracy": point})
    with pytest.raises(ConfigError, match="'accuracy' is registered here .* and also declared.*their_pkg:Acc"):
        build_evaluator("accuracy")


def test_user_file_and_module_forms(tmp_path):
    path = tmp_path / "my_eval.py"
    path.write_text(USER_EVALUATOR)
    evaluator = build_evaluator(f"{path}:ShortAnswers(limit=1)")
    result = evaluator.evaluate(make_batch(["1", "22", "333"]))
    assert result.metrics["short_ratio"].value == pytest.approx(1 / 3)
    assert evaluator.spec == "short(limit=1)"
    plain = build_evaluator(f"{path}:plain")
    assert registry.scalar_metrics(plain(make_batch(["a", "b"])), "plain") == {"count": 2.0}
    module_form = build_evaluator("verl.evaluators.reward:Reward")
    assert module_form.name == "reward"


def test_resolution_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="evaluator 'acuracy' is unknown; available: accuracy.*or give path"):
        build_evaluator("acuracy")
    with pytest.raises(ConfigError, match="does not exist"):
        build_evaluator(f"{tmp_path}/missing.py:X")
    (tmp_path / "e.py").write_text("class A: pass\n")
    with pytest.raises(ConfigError, match="defines no 'B'.*classes there: \\['A'\\]"):
        build_evaluator(f"{tmp_path}/e.py:B")
    with pytest.raises(ConfigError, match="bad options"):
        build_evaluator("diversity(colour=red)")
    with pytest.raises(ConfigError, match="listed twice"):
        build_evaluators("accuracy,accuracy")


def test_validation_runs_the_named_evaluators_and_plain_functions():
    import torch

    from verl.config import VerlConfig
    from verl.protocol import DataProto

    cfg = VerlConfig()
    cfg.trainer.evaluators = ["accuracy", "length"]
    evaluators = [*validation.build_validation_evaluators(cfg), lambda batch: {"custom": 1.0}]
    batch = DataProto.from_dict(
        {"response_mask": torch.ones((2, 3), dtype=torch.long)},
        {"index": [0, 1], "raw_prompt": ["p", "q"], "ground_truth": ["4", "5"], "data_source": ["arithmetic"] * 2},
    )

    def no_reference(data):
        raise AssertionError("no evaluator here needs reference log-probs")

    evaluated, _ = validation.run_validation_evaluators(cfg, evaluators, batch, [">> 4", "5"], np.array([1.0, 0.0]),
                                                        {"acc": np.array([1.0, 0.0])}, kl_terms=no_reference)
    metrics = {name: metric.value for name, metric in evaluated.items()}
    assert metrics["accuracy"] == 0.5 and metrics["accuracy_flexible"] == 1.0
    assert metrics["response_length_mean"] == 3.0 and metrics["custom"] == 1.0
    # kl needs the reference: without one it is refused with the fix; with one the roles compute the terms.
    cfg.trainer.evaluators = ["kl"]
    cfg.actor.use_kl_loss, cfg.algorithm.use_kl_in_reward = False, False
    with pytest.raises(ConfigError, match="needs the reference model.*reference.enable=true"):
        validation.build_validation_evaluators(cfg)
    cfg.reference.enable = True
    terms = {"policy_log_probs": torch.tensor([[-1.0, -2.0, 0.0], [-1.0, 0.0, 0.0]]),
             "ref_log_probs": torch.tensor([[-1.5, -2.0, 0.0], [-0.5, 0.0, 0.0]]),
             "token_kl": torch.tensor([[0.25, 0.5, 0.0], [0.75, 0.0, 0.0]])}
    evaluated, _ = validation.run_validation_evaluators(cfg, validation.build_validation_evaluators(cfg), batch,
                                                        ["a", "b"], np.zeros(2), {}, kl_terms=lambda data: terms)
    metrics = {name: metric.value for name, metric in evaluated.items()}
    assert metrics["kl_exact"] == pytest.approx((0.75 + 0.75) / 2)
    assert metrics["kl_k1"] == pytest.approx((0.5 - 0.5) / 2)  # k1 = logp - ref, summed per response


@pytest.mark.parametrize(
    ("evaluators", "overrides", "message"),
    [
        (["kl"], {"actor": {"use_kl_loss": False}}, "needs the reference model"),
        (["acuracy"], {}, "acuracy"),
    ],
)
def test_bad_trainer_evaluators_fail_before_the_first_step(tmp_path, evaluators, overrides, message):
    """Checked when fit() starts, not at the first validation (here there is none before step 1)."""
    from tests.test_trainer import tiny_config
    from verl.trainer.local import LocalPPOTrainer

    sections = {"trainer": {"test_freq": 1, "evaluators": evaluators}, **overrides}
    trainer = LocalPPOTrainer(tiny_config(tmp_path, **sections), quiet=True)
    with pytest.raises(ConfigError, match=message):
        trainer.fit()
    assert trainer.global_step == 0 and not trainer.run_dir.exists()
