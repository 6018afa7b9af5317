"""verl suite: RL post-training of causal LMs. Importing it defers a few third-party imports to first use
(``verl.utils.deferred_imports``: scikit-learn and scipy.optimize, which transformers imports with any model but
needs only for assisted decoding and detection losses), before transformers loads."""

from verl.utils import deferred_imports as _deferred_imports

_deferred_imports.install()
