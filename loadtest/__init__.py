"""Load testing for the inference service: Locust users (``locust -f loadtest/``) and a capacity report.

- ``locustfile.py``: plain and streaming users for ``/generate``, ``/v1/completions`` and ``/v1/chat/completions``;
  LLM numbers (time to first token, inter-token latency, tokens/s, output tokens) as custom Locust entries.
- ``shapes.py``: the stepped load shape (1, 2, 4, ... N users) used for capacity search.
- ``report.py``: Locust's ``--csv`` files -> capacity report (``verl loadtest-report``).
- ``run.py``: one command (``verl loadtest`` / ``make loadtest``): start the service on loopback, run the stepped
  test headless, stop the service, write the report.

``locust -f loadtest/`` imports every ``.py`` file here whose name does not start with ``_``; so every module in
this package is import-light and only ``locustfile.py`` defines users or registers Locust event handlers.
"""
