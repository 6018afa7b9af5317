"""Evaluation and comparison of checkpoints: ``verl eval`` and ``verl compare``.

- ``eval.evaluators``: the evaluator registry and the built-ins (reward, kl, diversity, accuracy, length);
- ``eval.runner``: generate once, compute log-probs once, run every evaluator, write results;
- ``eval.report``: Markdown/HTML reports and plots; ``eval.compare``: paired A/B comparison of runs;
- ``eval.stats``: standard errors, bootstrap, McNemar, pass@k.

Heavy dependencies (torch models, matplotlib) are imported inside functions, so ``import eval`` is cheap.
"""
