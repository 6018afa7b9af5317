"""verl suite: RL post-training of causal LMs. Importing it defers a few third-party imports to first use
(``verl.utils.deferred_imports``: scikit-learn inside transformers' generation code), before transformers loads."""

from verl.utils import deferred_imports as _deferred_imports

_deferred_imports.install()
