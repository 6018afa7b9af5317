"""Evaluation and comparison of checkpoints: ``verl eval`` and ``verl compare``.

- ``eval.runner``: generate once, compute log-probs once, run every evaluator, write results;
- ``eval.report``: Markdown/HTML reports and plots; ``eval.compare``: paired A/B comparison of runs;
- ``eval.online``: the same comparison over a live service's records (``verl compare --online``);
- ``eval.stats``: paired tests (paired bootstrap, McNemar).

The evaluators themselves (registry, built-ins, one model's error bars) live below the trainer, in
``verl.evaluators``, so training validation and ``verl eval`` run the same code. Heavy dependencies (torch models,
matplotlib) are imported inside functions, so ``import eval`` is cheap.
"""
