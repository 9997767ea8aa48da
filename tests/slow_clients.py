"""Abusive HTTP clients, run as a process of their own so that their work does not slow the test's own
client (tests/test_listener_limits.py): `--slow N` connections that trickle a request's headers a byte at
a time (and reconnect when the server closes them), and `--big N` clients that send request headers of
`--big-mib` MiB, one every `--big-every` seconds. Prints `ready` once every slow connection is open. Runs until killed.

    python -m tests.slow_clients --port 8080 --slow 500 --big 2 --big-mib 16
"""

from __future__ import annotations

import argparse
import asyncio
import sys

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\nX-Slow: "


async def slow(port: int, interval_s: float, opened: asyncio.Event, counter: list[int], total: int) -> None:
    first = True
    while True:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.2)
            continue
        if first:
            first = False
            counter[0] += 1
            if counter[0] == total:
                opened.set()
        try:
            writer.write(HEAD)
            while not reader.at_eof():
                writer.write(b"a")
                await writer.drain()
                try:
                    await asyncio.wait_for(reader.read(1024), interval_s)
                except asyncio.TimeoutError:
                    pass
        except OSError:
            pass
        finally:
            writer.close()


async def big(port: int, mib: int, every_s: float) -> None:
    block = b"a" * (64 << 10)
    while True:
        await asyncio.sleep(every_s)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nX-Big: ")
            for _ in range(mib * 16):
                writer.write(block)
                await writer.drain()
            writer.write(b"\r\n\r\n")
            await writer.drain()
            await asyncio.wait_for(reader.read(), 30)
            writer.close()
        except (OSError, asyncio.TimeoutError):
            await asyncio.sleep(0.05)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--slow", type=int, default=0)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between a slow client's bytes")
    ap.add_argument("--big", type=int, default=0)
    ap.add_argument("--big-mib", type=int, default=16)
    ap.add_argument("--big-every", type=float, default=0.5, help="seconds between a big client's requests")
    args = ap.parse_args()
    opened = asyncio.Event()
    counter = [0]
    tasks = [asyncio.create_task(slow(args.port, args.interval, opened, counter, args.slow)) for _ in range(args.slow)]
    if args.slow:
        await opened.wait()
    tasks += [asyncio.create_task(big(args.port, args.big_mib, args.big_every)) for _ in range(args.big)]
    print("ready", flush=True)
    await asyncio.gather(*tasks)


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
