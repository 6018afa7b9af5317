"""Tools for agents: Hermes tool calls (``calls``), the registry and verl-style tool config (``registry``), the
built-in ``calculator``, running calls safely (``runner``) and chat templates that render tools, with
conversations built token by token (``templates``). Shared by the multi-turn rollout, ``verl eval`` and the service.
"""
