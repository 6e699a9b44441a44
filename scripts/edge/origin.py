#!/usr/bin/env python3
"""The origin behind every proxy in scripts/bench-edge.sh: a small asyncio HTTP/1.1 server.

Keep-alive; reads request bodies by Content-Length or chunked coding; answers every request with
200 and a short body (after --delay-ms). It counts the connections it accepted, those open now and
the most open at once, and serves those counts on a second port: connect, send one line
("stats" or "reset"), read one JSON line. "reset" makes the peak the number open now.
"aborted" counts requests whose head or body the proxy began to send and never finished.
Only 127.0.0.1 is used.
"""
import argparse
import asyncio
import json
import os
import signal

STATS = {"accepted": 0, "open": 0, "peak": 0, "requests": 0, "aborted": 0}
RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n\r\nok\n"
RESPONSE_CLOSE = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n"
                  b"Connection: close\r\n\r\nok\n")
DELAY = 0.0


class Aborted(Exception):
    pass


async def read_body(reader, headers):
    te = headers.get(b"transfer-encoding", b"").lower()
    if te:
        if not te.endswith(b"chunked"):
            raise Aborted()
        while True:
            line = await reader.readline()
            if not line.endswith(b"\n"):
                raise Aborted()
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                # trailers, up to the empty line
                while True:
                    line = await reader.readline()
                    if not line.endswith(b"\n"):
                        raise Aborted()
                    if line in (b"\r\n", b"\n"):
                        return
            await reader.readexactly(size + 2)
    length = int(headers.get(b"content-length", b"0") or b"0")
    while length > 0:
        chunk = await reader.read(min(length, 65536))
        if not chunk:
            raise Aborted()
        length -= len(chunk)


async def handle(reader, writer):
    STATS["accepted"] += 1
    STATS["open"] += 1
    if STATS["open"] > STATS["peak"]:
        STATS["peak"] = STATS["open"]
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as error:
                if error.partial:
                    STATS["aborted"] += 1
                return
            lines = head.split(b"\r\n")
            version = lines[0].rsplit(b" ", 1)[-1]
            headers = {}
            for line in lines[1:]:
                if b":" in line:
                    name, value = line.split(b":", 1)
                    headers[name.strip().lower()] = value.strip()
            try:
                await read_body(reader, headers)
            except (Aborted, asyncio.IncompleteReadError, ValueError, ConnectionError, OSError):
                STATS["aborted"] += 1  # the proxy gave up on a request it had begun to send
                return
            STATS["requests"] += 1
            if DELAY:
                await asyncio.sleep(DELAY)
            close = (headers.get(b"connection", b"").lower() == b"close"
                     or version == b"HTTP/1.0")
            writer.write(RESPONSE_CLOSE if close else RESPONSE)
            await writer.drain()
            if close:
                return
    except (ConnectionError, asyncio.LimitOverrunError, OSError):
        pass  # reset between requests (or while answering): nothing was cut short on the way in
    finally:
        STATS["open"] -= 1
        writer.close()


async def stats(reader, writer):
    try:
        command = (await reader.readline()).strip()
        if command == b"reset":
            STATS["peak"] = STATS["open"]
        writer.write(json.dumps(STATS).encode() + b"\n")
        await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def main():
    global DELAY
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--stats-port", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args()
    DELAY = args.delay_ms / 1000
    server = await asyncio.start_server(handle, "127.0.0.1", args.port, backlog=4096,
                                        limit=65536, reuse_address=True)
    control = await asyncio.start_server(stats, "127.0.0.1", args.stats_port, reuse_address=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"origin listening on 127.0.0.1:{args.port}, stats on {args.stats_port}, pid {os.getpid()}",
          flush=True)
    async with server, control:
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(main())
