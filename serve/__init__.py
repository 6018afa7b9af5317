"""The inference service and model export.

- ``uvicorn serve.api:app`` serves ``VERL_SERVE_MODEL`` (an exported dir, a checkpoint dir or ``builtin:NAME``)
  behind an OpenAI-compatible API with Prometheus metrics (see ``docs/serving.md``).
- ``verl export`` turns a run's best/latest checkpoint into a self-contained Hugging Face model directory
  (``serve.export``).

``serve`` uses ``verl``'s model loading; ``verl`` core never imports ``serve``.
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"
# A child of uvicorn's logger: the service's lines appear in the server log with its format and level.
log = logging.getLogger("uvicorn.error.serve")
