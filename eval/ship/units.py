"""Which of a route's requests were randomized between the candidate and the incumbent, and with what probability.

The canary's tests (``eval.ship.sequential``) need *units*: requests whose arm was drawn at random given everything
before them, each with its known probability ``q`` of the candidate. On a route the service draws the model as
``serve.registry.draw`` does:

- a request with no ``user`` draws afresh: every such request is a unit, ``q`` = the candidate's share among the
  two arms at the config version it was routed under;
- a request with a ``user`` lands where the user's fixed hash falls on [0, 1), laid out as the route's weights in
  order (the candidate last). A user's first request at a version is a unit; their next ones at the same version are
  not (their arm is already known: counting them as fresh draws is what let one user's skill inflate alpha). Each
  request also narrows where the user's hash can lie, so at a later stage the user's ``q`` is the candidate's part
  of that narrowed interval: a user the incumbent answered at 5% moves to the candidate at 25% with probability
  (0.25 - 0.05) / 0.95, one the candidate answered stays there (``q`` = 1: not a unit).

Rows routed under a config version the canary did not set (a concurrent admin change) are not units.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def spans(weights: dict[str, float]) -> dict[str, tuple[float, float]]:
    """Where each model's users fall on [0, 1) for a route's ``weights`` (in order; weight 0 takes no room), as
    ``serve.registry.draw`` lays them out."""
    total = sum(w for w in weights.values() if w > 0)
    out, start = {}, 0.0
    for name, weight in weights.items():
        if weight <= 0 or total <= 0:
            out[name] = (start, start)
            continue
        out[name] = (start, start + weight / total)
        start += weight / total
    return out


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


@dataclass
class UserHistory:
    low: float = 0.0  # the user's hash lies in [low, high)
    high: float = 1.0
    last_version: int = -1
    unit_version: int = -1  # the version of the user's last unit


@dataclass
class Randomization:
    """Decides, row by row in routing order, whether a request is a unit and its ``q`` (see the module docstring)."""

    incumbent: str
    candidate: str
    layouts: dict[int, dict[str, tuple[float, float]]] = field(default_factory=dict)
    users: dict[str, UserHistory] = field(default_factory=dict)
    unknown_version: int = 0  # rows routed under a version the canary did not set
    repeats: int = 0  # rows of a user already counted at their version

    def add_layout(self, version: int, weights: dict[str, float]) -> None:
        """The route's weights at config ``version`` (as the admin API answered the change)."""
        self.layouts[int(version)] = spans(weights)

    def assign(self, version: int | None, model: str, user: str | None) -> float | None:
        """``q`` when this request is a unit, else None; updates the user's history either way."""
        layout = self.layouts.get(int(version)) if version is not None else None
        if layout is None:
            self.unknown_version += 1
            return None
        mine = layout.get(model, (0.0, 0.0))
        cand = layout.get(self.candidate, (0.0, 0.0))
        inc = layout.get(self.incumbent, (0.0, 0.0))
        if user is None:
            c, i = cand[1] - cand[0], inc[1] - inc[0]
            return c / (c + i) if model in (self.candidate, self.incumbent) and 0 < c < c + i else None
        history = self.users.setdefault(user, UserHistory())
        q = None
        if model in (self.candidate, self.incumbent):
            if version < history.last_version or version == history.unit_version:
                self.repeats += 1
            else:
                known = (history.low, history.high)
                c, i = overlap(cand, known), overlap(inc, known)
                if c > 0 and i > 0:
                    q = c / (c + i)
                    history.unit_version = version
        history.low, history.high = max(history.low, mine[0]), min(history.high, mine[1])
        history.last_version = max(history.last_version, version)
        return q
