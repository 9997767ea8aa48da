"""A TCP relay that can partition: a node's agent talks to the node API and to Temporal through one each,
and `block()` makes that path a black hole (bytes are held, not refused, as a real partition delays packets
rather than resetting connections; new connections are accepted and held too). `heal()` lets everything
through again. Runs its own event loop in a thread; `close()` drops every connection."""

from __future__ import annotations

import asyncio
import threading

from llmgw.dev.procs import free_port


class PartitionableRelay:
    def __init__(self, target_port: int, name: str):
        self.name = name
        self.target_port = target_port
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._open: asyncio.Event | None = None
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=f"relay-{name}", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError(f"relay {name} did not start")

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._open = asyncio.Event()
            self._open.set()
            self._server = await asyncio.start_server(self._client, "127.0.0.1", self.port)
        self._loop.run_until_complete(start())
        ready.set()
        self._loop.run_forever()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._open is not None
        self._writers.add(writer)
        try:
            await self._open.wait()  # a connection made during a partition waits for it to heal
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            self._writers.discard(writer)
            return
        self._writers.add(up_writer)
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True)
        for w in (writer, up_writer):
            w.close()
            self._writers.discard(w)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._open is not None
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                await self._open.wait()  # partitioned: hold what was read until the path heals
                writer.write(data)
                await writer.drain()
        finally:
            if writer.can_write_eof():
                try:
                    writer.write_eof()
                except OSError:
                    pass

    def _call(self, fn) -> None:
        done = threading.Event()

        def run() -> None:
            fn()
            done.set()
        self._loop.call_soon_threadsafe(run)
        done.wait(10)

    def block(self) -> None:
        """Partition: nothing gets through in either direction until `heal()`."""
        self._call(lambda: self._open.clear())  # type: ignore[union-attr]

    def heal(self) -> None:
        self._call(lambda: self._open.set())  # type: ignore[union-attr]

    def close(self) -> None:
        def stop() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):
                w.close()
            self._open.set()  # type: ignore[union-attr]
        self._call(stop)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
