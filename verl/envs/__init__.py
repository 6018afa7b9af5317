"""Environments the agent loop drives (docs/architecture.md §16, docs/environments.md)."""
