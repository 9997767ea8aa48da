"""The deny-list of node certificates as one node-API process holds it (issue 36).

`llmgw ctl cert revoke NODE` writes a row to Postgres (db/revocations_repo.py); each node-API process reads
the whole table every `revocation_refresh_s` (5 s) and refuses every request made over a revoked
certificate (403 `certificate_revoked`), a renewal included: a revoked node is refused at its next request,
whatever connection it is on, and cannot renew its way out. A certificate is revoked when its serial is
listed, or when its node has an "issued before" cutoff after the second it was issued in
(`pki.issued_at`: certificates carry whole seconds, so one issued in the very second of the revocation is
revoked too; issue the node's new one after). A renewal reads the list afresh before it signs: a node
revoked a moment ago cannot renew its way out in the refresh interval.

The node API reads the list before it listens (`first_load`): a process that cannot read the list does not
serve as if nothing were revoked (were a request to come first anyway, it gets 503 `revocations_unknown` and
the node retries). A later read that fails keeps the last list and says so in the log; the node API cannot
serve without Postgres anyway.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.db import revocations_repo
from llmgw.security.pki import issued_at

log = logging.getLogger(__name__)


class DenyListUnknown(Exception):
    """The deny-list has not been read yet: nothing can be said about any certificate."""


@dataclass(frozen=True)
class Revoked:
    """Why a certificate is refused; `str()` is the refusal's message."""

    node_id: str
    serial: str
    reason: str
    whole_node: bool

    def __str__(self) -> str:
        what = (f"every certificate of node {self.node_id} issued before its revocation" if self.whole_node
                else f"certificate {self.serial} of node {self.node_id}")
        why = f" ({self.reason})" if self.reason else ""
        return (f"{what} is revoked{why}; an operator lets the node back with a new certificate "
                f"(llmgw ctl cert node {self.node_id} --force) copied to it")


class DenyList:
    """Serials and per-node cutoffs, re-read every `refresh_s` by `run()`."""

    def __init__(self, engine: AsyncEngine, refresh_s: float):
        self.engine = engine
        self.refresh_s = refresh_s
        self.serials: dict[str, revocations_repo.Revocation] = {}
        self.cutoffs: dict[str, revocations_repo.Revocation] = {}  # node id -> its latest cutoff's row
        self.loaded = False

    async def load(self) -> None:
        async with self.engine.connect() as conn:
            rows = await revocations_repo.all_revocations(conn)
        serials, cutoffs = {}, {}
        for r in rows:
            if r.serial is not None:
                serials[r.serial] = r
            elif r.issued_before is not None:
                if r.node_id not in cutoffs or cutoffs[r.node_id].issued_before < r.issued_before:
                    cutoffs[r.node_id] = r
        self.serials, self.cutoffs, self.loaded = serials, cutoffs, True

    async def first_load(self, stop: asyncio.Event) -> bool:
        """Read the list, retrying every second (logged) until it is read (True) or `stop` is set (False)."""
        while not stop.is_set():
            try:
                await self.load()
                return True
            except Exception as exc:  # noqa: BLE001 - Postgres not there yet: wait for it
                log.warning("cannot read the deny-list of node certificates yet (%s); the node API listens once "
                            "it is read", exc)
                try:
                    await asyncio.wait_for(stop.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
        return False

    async def run(self) -> None:
        """Read the list every `refresh_s` (after `first_load`), for as long as the process serves."""
        failing = False
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.load()
                if failing:
                    log.info("the deny-list of node certificates is read again")
                failing = False
            except Exception:  # noqa: BLE001 - Postgres away: keep the last list and keep trying
                if not failing:
                    log.exception("reading the deny-list of node certificates failed; %s",
                                  "keeping the last one read" if self.loaded else "refusing nodes until it is read")
                failing = True

    def refusal(self, node_id: str, serial: str, not_before: datetime) -> Revoked | None:
        """Why the certificate (`node_id` its common name, `serial` lower-case hex, `not_before` aware UTC)
        is refused, or None. Raises `DenyListUnknown` before the list has been read."""
        if not self.loaded:
            raise DenyListUnknown("the deny-list of node certificates has not been read yet")
        if (row := self.serials.get(serial)) is not None:
            return Revoked(node_id, serial, row.reason, whole_node=False)
        row = self.cutoffs.get(node_id)
        if row is not None and issued_at(not_before) < row.issued_before:
            return Revoked(node_id, serial, row.reason, whole_node=True)
        return None
