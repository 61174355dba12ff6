"""The route table: one per app, a row per route — method, path, and the route's policy, read by the shared parts
that act before or around the route: the edge (``edge.py``: ``admin`` wants the admin key, ``queued`` counts in
admission from the edge on), the body reader (``bodies.py``: ``precheck`` runs on the raw JSON first) and the error
handlers (``errors.py``: ``openai`` answers in OpenAI's shape, else the house shape). The table's own ``openai`` is
the shape of a path no row has (an unknown route), ``groups`` the house shape's one-of field groups and
``max_brackets`` the body reader's bound on a body's JSON containers.

A mode's app module writes its table next to its routes; ``app.new_app`` adds the rows every app shares
(``/health``, ``/metrics``) and a test checks that every route of every app has its row.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from grserve.inputs.limits import MAX_BRACKETS, Precheck


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # the path template, as the route is declared
    queued: bool = False  # it queues work (in the engine, or in the heavy-work pool): admission from the edge on
    admin: bool = False  # it changes server state: the admin key (off while --admin-api-key is unset)
    precheck: Precheck | None = None  # cheap checks of its raw JSON body, before it is validated
    openai: bool = False  # its errors in OpenAI's shape (else the house shape)


class RouteTable:
    """An app's routes and their policy, looked up by (method, path) or by path."""

    def __init__(self, routes: Iterable[Route], *, openai: bool = False, groups: tuple[str, ...] = (),
                 max_brackets: int = MAX_BRACKETS) -> None:
        self.routes: list[Route] = []
        self._rows: dict[tuple[str, str], Route] = {}
        self.openai, self.groups, self.max_brackets = openai, groups, max_brackets
        self.add(*routes)

    def add(self, *routes: Route) -> None:
        for r in routes:
            if (r.method, r.path) in self._rows:
                raise ValueError(f"route {r.method} {r.path} is in the table twice")
            self._rows[(r.method, r.path)] = r
            self.routes.append(r)

    def row(self, method: str, path: str) -> Route | None:
        return self._rows.get((method, path))

    def queued(self, method: str, path: str) -> bool:
        r = self.row(method, path)
        return r is not None and r.queued

    def admin(self, method: str, path: str) -> bool:
        r = self.row(method, path)
        return r is not None and r.admin

    def precheck(self, path: str) -> Precheck | None:
        """The precheck of the route declared at ``path`` (the body reader knows a route by its path template)."""
        return next((r.precheck for r in self.routes if r.path == path and r.precheck is not None), None)

    def openai_shape(self, path: str) -> bool:
        """Whether an error on ``path`` is answered in OpenAI's shape: its routes' choice, else the table's."""
        rows = [r for r in self.routes if r.path == path]
        return rows[0].openai if rows else self.openai


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's ``responses=`` for the OpenAPI schema: the error statuses it may answer."""
    return {k: {} for k in statuses}

