#!/usr/bin/env python3
"""Markdown tables from the JSON lines of scripts/edge/attack.py: one table per attack, the
proxies side by side (in the order they first appear), one column each; when a proxy ran more
than once, a cell lists every run's value, "a / b", unless they are all the same.

  report.py RESULTS.jsonl        the tables
  report.py --brief RESULT.json  one line about one run"""
import json
import sys


def fmt_cutoffs(cutoffs):
    if not cutoffs:
        return "0"
    parts = [f"{n} × {reason}" for reason, n in sorted(cutoffs.items(), key=lambda kv: -kv[1])]
    if len(parts) == 1:
        return parts[0]
    return f"{sum(cutoffs.values())}: " + ", ".join(parts)


def normal_rows(r):
    n = r["normal"]
    pct = 100.0 * n["ok"] / n["requests"] if n["requests"] else 0.0
    failures = {k: v for k, v in n["outcomes"].items() if k != "200"}
    other = ", ".join(f"{v} × {k}" for k, v in sorted(failures.items(), key=lambda kv: -kv[1]))
    return [
        f"{n['ok']}/{n['requests']} ({pct:.1f} %)" + (f"; {other}" if other else ""),
        "–" if n["p50_ms"] is None else f"{n['p50_ms']:.1f}",
        "–" if n["p99_ms"] is None else f"{n['p99_ms']:.1f}",
    ]


def mib(kib):
    return f"{kib / 1024:.1f}"


def growth(kib, start):
    return f"{mib(kib)} ({(kib - start) / 1024:+.1f})"


def memory_rows():
    """The proxy's RSS (all its processes), MiB, and the change from the start."""
    def after(r):
        m = r["memory"]
        return growth(m["after_kib"], m["start_kib"])
    return [
        ("proxy RSS at the start, MiB", lambda r: mib(r["memory"]["start_kib"])),
        ("... at its peak (change)", lambda r: growth(r["memory"]["peak_kib"], r["memory"]["start_kib"])),
        ("... at the end of the attack (change)", lambda r: growth(r["memory"]["end_kib"], r["memory"]["start_kib"])),
        ("... after the clients left (change)", after),
    ]


def stopped_early(r):
    if not r.get("stopped_early"):
        return "no"
    return f"after {r['stopped_after_s']} s: {r['stopped_early']}"


def per_byte(r):
    sent = r["attack_client"]["bytes_sent"]
    if not sent:
        return "–"
    return f"{(r['memory']['peak_kib'] - r['memory']['start_kib']) * 1024 / sent:,.0f}"


def upload_rows():
    return [
        ("most upstream connections held at once", lambda r: r["origin"]["peak_open"]),
        ("... sampled every 250 ms", lambda r: r["origin"]["peak_open_sampled"]),
        ("upstream connections the origin accepted", lambda r: r["origin"]["accepted"]),
        ("upstream connections open after the clients left", lambda r: r["origin"].get("open_after_settle", "–")),
        ("uploader connections (most at once)", lambda r: f"{r['attack_client']['connections']} ({r['attack_client']['most_connected_at_once']})"),
        ("times the proxy cut an uploader off", lambda r: fmt_cutoffs(r["attack_client"]["cutoffs"])),
        ("body bytes sent", lambda r: r["attack_client"]["bytes_sent"]),
    ]


def fmt_counts(counts):
    if not counts:
        return "0"
    return ", ".join(f"{n} × {what}" for what, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def closed(side):
    ends = side["closed_by_proxy"]
    if not ends:
        return "0"
    t = side["closed_after_s"]
    return f"{fmt_cutoffs(ends)}; after {t['min']:g}-{t['max']:g} s (median {t['median']:g})"


def kib_per_connection(r):
    """RSS growth at the first count (everyone connected) over the connections then open."""
    first = r["attack_client"]["open_at"][0]
    held = first["half"] + first["idle"]
    if not held:
        return "–"
    return f"{(first['rss_kib'] - r['memory']['start_kib']) / held:.1f}"


def admin_metrics(rs):
    checkpoints = sorted({c["after_s"] for r in rs for c in r["attack_client"]["open_at"] if not c.get("end")})

    def open_after(seconds):
        def f(r):
            for c in r["attack_client"]["open_at"]:
                if c["after_s"] == seconds and not c.get("end"):
                    return f"{c['half']} / {c['idle']}"
            return "–"
        return f

    def open_at_end(r):
        c = [c for c in r["attack_client"]["open_at"] if c.get("end")][0]
        return f"{c['half']} / {c['idle']} (at {c['after_s']:g} s)"
    a = lambda r: r["attack_client"]  # noqa: E731
    return ([
        ("what they GET", lambda r: r["params"].get("path", "/")),
        ("connections opened: half heads / idle", lambda r: f"{a(r)['half']['connected']} / {a(r)['idle']['connected']}"),
        ("connects that failed", lambda r: fmt_counts({**a(r)["half"]["connect_failures"], **a(r)["idle"]["connect_failures"]})),
        ("idle connections' answers", lambda r: fmt_counts(a(r)["idle"]["answers"])),
    ] + [(f"still open after {t:g} s: half heads / idle", open_after(t)) for t in checkpoints] + [
        ("still open at the end: half heads / idle", open_at_end),
        ("half heads the proxy closed", lambda r: closed(a(r)["half"])),
        ("idle connections the proxy closed", lambda r: closed(a(r)["idle"])),
        (f"RSS per held connection after {checkpoints[0]:g} s, KiB" if checkpoints else "RSS per held connection, KiB", kib_per_connection),
    ] + memory_rows())


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        out.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(out)


def brief(path):
    r = json.load(open(path))
    n, o, a = r["normal"], r["origin"], r["attack_client"]
    line = (f"  upstream connections {o['accepted']} (at most {o['peak_open']} at once), "
            f"normal client {n['ok']}/{n['requests']} p99 {n['p99_ms']} ms, ")
    if r["attack"] == "admin-hold":
        line += "still open (half heads / idle): " + ", ".join(
            f"{c['half']} / {c['idle']} at {c['after_s']:g} s" for c in a["open_at"])
    else:
        line += f"cut-offs {fmt_cutoffs(a['cutoffs'])}"
    if "memory" in r:
        m = r["memory"]
        line += (f", RSS {mib(m['start_kib'])} -> peak {mib(m['peak_kib'])} -> "
                 f"{mib(m['after_kib'])} MiB after")
    if r.get("stopped_early"):
        line += f" (ended after {r['stopped_after_s']} s: {r['stopped_early']})"
    print(line + f", proxy CPU {r['proxy_cpu_pct']} %")


def main():
    if sys.argv[1] == "--brief":
        return brief(sys.argv[2])
    runs = [json.loads(line) for line in open(sys.argv[1]) if line.strip().startswith("{")]
    for attack in ("rapid-reset", "slow-upload", "big-uploads", "byte-bodies", "byte-bodies-h2",
                   "admin-hold"):
        rs = [r for r in runs if r["attack"] == attack]
        if not rs:
            continue
        labels = list(dict.fromkeys(r["proxy"] for r in rs))
        by_proxy = {label: [r for r in rs if r["proxy"] == label] for label in labels}
        if attack == "rapid-reset":
            a, p = rs[0], rs[0].get("params", {})
            print(f"Rapid reset over h2c, {a['seconds']:g} s: bursts of {p.get('burst', 19)} x "
                  f"(HEADERS, RST_STREAM CANCEL) every {p.get('interval_ms', 5):g} ms, reconnecting "
                  f"whenever cut off; normal client: one h2c GET every "
                  f"{p.get('normal_interval_ms', 100):g} ms on a new connection\n")
            metrics = [
                ("upstream connections the origin accepted", lambda r: r["origin"]["accepted"]),
                ("most upstream connections open at once", lambda r: r["origin"]["peak_open"]),
                ("requests the origin received", lambda r: r["origin"]["requests"]),
                ("streams the attacker opened (HEADERS sent)", lambda r: r["attack_client"]["streams_sent"]),
                ("... at or below GOAWAY's last stream id", lambda r: r["attack_client"]["streams_opened"]),
                ("attacker connections", lambda r: r["attack_client"]["connections"]),
                ("times the proxy cut the attacker off", lambda r: fmt_cutoffs(r["attack_client"]["cutoffs"])),
                ("first GOAWAY after (s)", lambda r: r["attack_client"]["first_goaway_after_s"] if r["attack_client"]["first_goaway_after_s"] is not None else "–"),
                ("responses (HEADERS) the attacker got", lambda r: r["attack_client"]["responses"]),
                ("RST_STREAM from the proxy", lambda r: r["attack_client"]["server_resets"]),
                ("proxy CPU (% of one core)", lambda r: r["proxy_cpu_pct"]),
            ]
        elif attack == "slow-upload":
            a, p = rs[0], rs[0].get("params", {})
            print(f"{p.get('uploaders', 500)} slow uploaders over HTTP/1.1, {a['seconds']:g} s: "
                  f"POST /upload, Content-Length: {p.get('body_bytes', 100000)}, one body byte a "
                  f"second, reconnecting whenever cut off; normal client: one HTTP/1.1 GET every "
                  f"{p.get('normal_interval_ms', 100):g} ms on a new connection\n")
            metrics = [
                ("most upstream connections open at once", lambda r: r["origin"]["peak_open"]),
                ("... sampled every 250 ms", lambda r: r["origin"]["peak_open_sampled"]),
                ("upstream connections the origin accepted", lambda r: r["origin"]["accepted"]),
                ("uploader connections (most at once)", lambda r: f"{r['attack_client']['connections']} ({r['attack_client']['most_connected_at_once']})"),
                ("times the proxy cut an uploader off", lambda r: fmt_cutoffs(r["attack_client"]["cutoffs"])),
                ("body bytes sent", lambda r: r["attack_client"]["bytes_sent"]),
                ("proxy CPU (% of one core)", lambda r: r["proxy_cpu_pct"]),
            ]
        elif attack == "big-uploads":
            a, p = rs[0], rs[0].get("params", {})
            print(f"{p['uploaders']} big slow uploads over HTTP/1.1, {a['seconds']:g} s: "
                  f"POST /upload, Content-Length: {p['body_bytes']}, {p['byte_rate']:g} body "
                  f"byte(s) a second, reconnecting whenever cut off; normal client: one HTTP/1.1 "
                  f"GET every {p['normal_interval_ms']:g} ms on a new connection\n")
            metrics = upload_rows() + memory_rows() + [
                ("proxy CPU (% of one core)", lambda r: r["proxy_cpu_pct"]),
            ]
        elif attack in ("byte-bodies", "byte-bodies-h2"):
            a, p = rs[0], rs[0].get("params", {})
            how = ("HTTP/1.1: POST /upload with Content-Length" if attack == "byte-bodies" else
                   "h2c: HEADERS for POST /upload with content-length")
            unit = "one byte per TCP segment" if attack == "byte-bodies" else "one DATA frame of one byte per TCP segment"
            clients = f"{p['uploaders']} client" + ("s" if p["uploaders"] != 1 else "")
            print(f"{clients}, {a['seconds']:g} s, over {how}: {p['body_bytes']}, "
                  f"then the body {unit}, {p['byte_rate']:g} bytes a second each, reconnecting "
                  f"whenever cut off; normal client: one {'HTTP/1.1' if p['normal_proto'] == 'http1' else 'h2c'} "
                  f"GET every {p['normal_interval_ms']:g} ms on a new connection\n")
            metrics = memory_rows() + [
                ("RSS growth (peak) per body byte sent, bytes", per_byte),
                ("attack ended early", stopped_early),
            ] + upload_rows() + [
                ("proxy CPU (% of one core)", lambda r: r["proxy_cpu_pct"]),
            ]
        else:  # admin-hold
            a, p = rs[0], rs[0].get("params", {})
            print(f"Management port, {a['seconds']:g} s: {p['clients']} connections send half a "
                  f"request head (no blank line) and stop, {p['clients']} send one keep-alive GET "
                  f"and sit idle; nobody reconnects; normal client: one HTTP/1.1 GET on the same "
                  f"port every {p['normal_interval_ms']:g} ms on a new connection\n")
            metrics = admin_metrics(rs) + [
                ("proxy CPU (% of one core)", lambda r: r["proxy_cpu_pct"]),
            ]
        metrics += [
            ("normal client: 200s", lambda r: normal_rows(r)[0]),
            ("normal client: p50 ms", lambda r: normal_rows(r)[1]),
            ("normal client: p99 ms", lambda r: normal_rows(r)[2]),
        ]

        def cell(f, runs):
            values = [str(f(r)) for r in runs]
            return values[0] if len(set(values)) == 1 else " / ".join(values)
        rows = [[name] + [cell(f, by_proxy[label]) for label in labels] for name, f in metrics]
        most_runs = max(len(v) for v in by_proxy.values())
        if most_runs > 1:
            print(f"({most_runs} runs per proxy: a / b is each run's value)\n")
        print(table([""] + labels, rows))
        print()


if __name__ == "__main__":
    main()
