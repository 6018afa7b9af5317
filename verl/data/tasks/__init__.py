"""Built-in tasks."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict


class SpecKey:
    """``key()``: a short stable identifier of a (dataclass) task spec, used to name its cached parquet files."""

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]
