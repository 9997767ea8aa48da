"""Names the route table does not know, asked of the stored catalog before a 404 (read-your-writes).

`ctl apply` returns once the catalog is committed; the route table learns of it by NOTIFY (db/feed.py),
a few milliseconds later on this gateway and on every other. A client that asks for the new model in
between would get 404 `model_not_found` for a model the operator was just told exists. So a miss asks the
database whether the name is stored (by name or alias) and, if it is, waits for a refresh of the route
table that began after the answer.

A flood of unknown names must not become a flood of queries: misses are batched, one query at a time per
gateway (the misses that arrive during one wait for the next), and a name that cannot be a model name
(`schemas.catalog.name_problem`) is never asked about. A name that is stored but that the route table still
does not hold after a refresh (a stored model this version cannot read; `catalog_repo.get_catalog` logs
it) is not asked about again until the catalog changes.
"""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.db import catalog_repo
from llmgw.schemas.catalog import name_problem

log = logging.getLogger(__name__)
BATCH_MAX = 512  # names per query; more misses at once wait for the next query


class MissCheck:
    """`stored(name)`: is `name` in the stored catalog now? Batched; one query in flight."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self._waiting: dict[str, list[asyncio.Future[bool]]] = {}
        self._runner: asyncio.Task | None = None

    async def stored(self, name: str) -> bool:
        if name_problem(name) is not None:
            return False
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(name, []).append(fut)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run(), name="route-misses")
        return await asyncio.shield(fut)

    async def _run(self) -> None:
        while self._waiting:
            names = list(self._waiting)[:BATCH_MAX]
            batch = {n: self._waiting.pop(n) for n in names}
            try:
                async with self.engine.connect() as conn:
                    found = await catalog_repo.stored_names(conn, names)
            except Exception as exc:  # noqa: BLE001 - the database is away: answer from the route table (404)
                log.warning("could not check %d unknown model name(s) against the catalog: %s", len(names), exc)
                found = set()
            for n, futs in batch.items():
                for f in futs:
                    if not f.done():
                        f.set_result(n in found)
