"""One exception hierarchy for every error a user can act on.

The CLI prints ``VerlError`` messages as one readable line (the traceback only with ``--debug``);
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class VerlError(Exception):
    """Base class: the message says what is wrong, where, and how to fix it."""


class ConfigError(VerlError):
    """A config key, type or value is invalid."""


class DataError(VerlError):
    """A dataset file, column or row is invalid or missing."""


class ModelError(VerlError):
    """A model path cannot be resolved or loaded."""


class CheckpointError(VerlError):
    """A checkpoint is missing, partial or incompatible."""


class DataProtoValidationError(VerlError):
    """A tensor in a DataProto has the wrong shape or dtype (raised under VERL_STRICT_DATA_CHECK=1)."""


class MissingDependencyError(VerlError):
    """An optional package is needed for the requested feature."""

    def __init__(self, package: str, feature: str, install: str | None = None):
        self.package = package
        cmd = install or f"pip install {package}"
        super().__init__(f"{feature} needs the '{package}' package, which is not installed. Install it with: {cmd}")
