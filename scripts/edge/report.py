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


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        out.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(out)


def brief(path):
    r = json.load(open(path))
    n, o, a = r["normal"], r["origin"], r["attack_client"]
    print(f"  upstream connections {o['accepted']} (at most {o['peak_open']} at once), "
          f"normal client {n['ok']}/{n['requests']} p99 {n['p99_ms']} ms, "
          f"cut-offs {fmt_cutoffs(a['cutoffs'])}, proxy CPU {r['proxy_cpu_pct']} %")


def main():
    if sys.argv[1] == "--brief":
        return brief(sys.argv[2])
    runs = [json.loads(line) for line in open(sys.argv[1]) if line.strip().startswith("{")]
    for attack in ("rapid-reset", "slow-upload"):
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
        else:
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
