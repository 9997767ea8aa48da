"""What counts as demand for an on-demand model, decided in Postgres (`catalog_repo.record_demand`), so a
failure counted a moment ago is never missed by a gateway that read the model's status before it: no
demand during a backoff, and a held request's renewal only if no start failed since the last demand. The
same through the real gateway and control plane: tests/test_on_demand_failures.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select, update

from llmgw.db import catalog_repo
from llmgw.db.engine import async_engine
from llmgw.db.tables import model_state

pytestmark = pytest.mark.integration


async def test_demand_is_not_counted_in_a_backoff_and_a_renewal_not_after_a_failure(database_url):
    engine = async_engine(database_url)

    async def state():
        async with engine.connect() as conn:
            return (await conn.execute(select(model_state).where(model_state.c.name == "od"))).one()

    async def step(fn, *args):
        async with engine.begin() as conn:  # one transaction each: now() is its start
            await fn(conn, *args)

    try:
        await step(catalog_repo.record_demand, "od")
        asked = (await state()).demand_at
        async with engine.begin() as conn:
            now = await conn.scalar(select(model_state.c.demand_at).where(model_state.c.name == "od"))
            await catalog_repo.record_failure(conn, "od", now + timedelta(seconds=600))
        failed = await state()
        assert failed.failed_at > asked and failed.failures == 1

        await step(catalog_repo.record_demand, "od")  # a request during the backoff: answered, not counted
        assert (await state()).demand_at == asked
        async with engine.begin() as conn:  # the backoff runs out
            await conn.execute(update(model_state).where(model_state.c.name == "od")
                               .values(backoff_until=failed.failed_at))
        await step(catalog_repo.record_demand, "od", True)  # the request held through the failure: spent
        assert (await state()).demand_at == asked

        await step(catalog_repo.record_demand, "od")  # a new request after the backoff counts
        again = (await state()).demand_at
        assert again > failed.failed_at
        await step(catalog_repo.record_demand, "od", True)  # and so does its renewal
        assert (await state()).demand_at > again

        await step(catalog_repo.reset_failures, "od")  # a start reached Ready, or ctl retry
        cleared = await state()
        assert cleared.failed_at is None and cleared.failures == 0 and cleared.backoff_until is None
    finally:
        await engine.dispose()
