"""The code sandbox: untrusted programs (a model's code, a row's unit tests) run isolated and limited.

``isolation.py`` says how (bubblewrap namespaces, a pids cgroup, limits), ``runner.py`` runs one program and
answers in SandboxFusion's ``/run_code`` shape, ``server.py`` serves that over HTTP (``verl sandbox serve``).
"""

from verl.sandbox.isolation import Limits, mechanism
from verl.sandbox.runner import RunCodeRequest, RunCodeResponse, Sandbox, SandboxUnavailable

__all__ = ["Limits", "RunCodeRequest", "RunCodeResponse", "Sandbox", "SandboxUnavailable", "mechanism"]
