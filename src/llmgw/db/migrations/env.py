"""Alembic environment: uses the connection handed in by `llmgw.db.migrate.upgrade`, or the URL."""

from alembic import context

from llmgw.db.engine import sync_engine
from llmgw.db.tables import metadata

config = context.config
target_metadata = metadata


def run() -> None:
    conn = config.attributes.get("connection")
    if conn is not None:
        context.configure(connection=conn, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = sync_engine(config.get_main_option("sqlalchemy.url"))
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()


run()
