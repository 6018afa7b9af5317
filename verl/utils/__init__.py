"""Shared utilities: structured logging (``from verl.utils import log``), timing, seeding, env checks."""
