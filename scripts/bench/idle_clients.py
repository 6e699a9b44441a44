#!/usr/bin/env python3
"""Opens many idle keep-alive client connections to a proxy, for scripts/bench-proxy.sh.

Each connection sends one HTTP/1.1 GET and reads the whole response, then stays open and
idle, the way browsers and API clients keep connections to a gateway (with --no-request it
only connects and sends nothing). After every connection
is set up the client prints "ready OK FAILED", holds them for --hold seconds (the caller measures
the proxy's memory meanwhile), then prints "open N": how many the proxy still kept open.

Standard library only, so the benchmark needs no build step. Only the address given is
contacted (the benchmark passes 127.0.0.1).
"""

import argparse
import asyncio
import sys

REQUEST = b"GET / HTTP/1.1\r\nHost: bench\r\nUser-Agent: raahi-bench-idle\r\n\r\n"


async def open_one(host, port, timeout, request):
    """One connection after one complete exchange (or none), or None when it failed."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return None
    if not request:
        return reader, writer
    try:
        writer.write(REQUEST)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        if length:
            await asyncio.wait_for(reader.readexactly(length), timeout)
        if not head.startswith(b"HTTP/1.1 200"):
            raise ValueError(head.split(b"\r\n", 1)[0])
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError,
            asyncio.LimitOverrunError):
        writer.close()
        return None
    return reader, writer


async def still_open(reader):
    """False when the proxy closed the connection (EOF or reset) while it was idle."""
    try:
        data = await asyncio.wait_for(reader.read(1), 0.05)
    except asyncio.TimeoutError:
        return True
    except OSError:
        return False
    return bool(data)


async def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--connections", type=int, default=10000)
    parser.add_argument("--batch", type=int, default=250, help="connections opened at once")
    parser.add_argument("--hold", type=float, default=5.0, help="seconds to stay idle")
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--no-request", action="store_true",
                        help="connect only; send no request")
    args = parser.parse_args()

    opened = []
    failed = 0
    for start in range(0, args.connections, args.batch):
        count = min(args.batch, args.connections - start)
        results = await asyncio.gather(
            *(open_one(args.host, args.port, args.timeout, not args.no_request) for _ in range(count)))
        for result in results:
            if result is None:
                failed += 1
            else:
                opened.append(result)
    print(f"ready {len(opened)} {failed}", flush=True)
    await asyncio.sleep(args.hold)
    alive = 0
    for start in range(0, len(opened), 1000):
        checks = await asyncio.gather(
            *(still_open(reader) for reader, _ in opened[start:start + 1000]))
        alive += sum(checks)
    print(f"open {alive}", flush=True)
    for _, writer in opened:
        writer.close()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(130)
