#!/usr/bin/env python3
"""Figures of scripts/bench-retry.sh.

  retry_report.py run --scenario S --proxy P --dir DIR [--skip N] [--tail N]
      reads DIR/requests.log (h2load --log-file: start time in µs since the epoch, status,
      µs to the end of the response; one line per answered request), DIR/h2load.txt and the
      targets' hit counters DIR/hits-before-*.json and DIR/hits-after-*.json
      (scripts/bench/retry_upstream.py's GET /__hits), and prints one JSON line.
  retry_report.py table FILE
      prints the markdown tables of the JSON lines in FILE.

Upstream attempts are the targets' own counts between the two readings; client requests are the
requests h2load got an answer for. "Window" figures count both by whole seconds of the clock
(the target counts a hit in the second it read the head, h2load logs the second it sent the
request): from the (skip+1)-th whole second after the first request to the tail-th whole second
before the last, so the load's ramp and its cut-off stay out.
"""
import glob
import json
import math
import os
import re
import sys


def percentile(values, p):
    """Nearest rank: the smallest value with at least p % of the values at or below it."""
    if not values:
        return None
    rank = max(1, math.ceil(p / 100 * len(values)))
    return values[rank - 1]


def load_hits(pattern):
    total, stalled, per_second = 0, 0, {}
    for path in sorted(glob.glob(pattern)):
        with open(path) as f:
            data = json.load(f)
        total += data["hits"]
        stalled += data["stalled"]
        for second, n in data["per_second"].items():
            per_second[int(second)] = per_second.get(int(second), 0) + n
    return total, stalled, per_second


def h2load_counts(path):
    counts = {}
    try:
        with open(path) as f:
            for line in f:
                m = re.match(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, "
                             r"(\d+) failed, (\d+) errored, (\d+) timeout", line)
                if m:
                    keys = ("total", "started", "done", "succeeded", "failed", "errored", "timeout")
                    counts = dict(zip(keys, map(int, m.groups())))
    except OSError:
        pass
    return counts


def run(args):
    opts = dict(zip(args[::2], args[1::2]))
    scenario, proxy, d = opts["--scenario"], opts["--proxy"], opts["--dir"]
    skip, tail = int(opts.get("--skip", 1)), int(opts.get("--tail", 1))
    rows = []
    with open(os.path.join(d, "requests.log")) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3:
                rows.append((int(parts[0]), int(parts[1]), int(parts[2])))
    if not rows:
        sys.exit(f"no requests in {d}/requests.log")
    rows.sort()
    before_total, before_stalled, before_ps = load_hits(os.path.join(d, "hits-before-*.json"))
    after_total, after_stalled, after_ps = load_hits(os.path.join(d, "hits-after-*.json"))
    hits_ps = {s: n - before_ps.get(s, 0) for s, n in after_ps.items() if n - before_ps.get(s, 0)}
    hits = after_total - before_total

    sent = h2load_counts(os.path.join(d, "h2load.txt")).get("started") or len(rows)
    first_us, last_us = rows[0][0], rows[-1][0]
    first_sec, last_sec = first_us // 1_000_000, last_us // 1_000_000
    lo, hi = first_sec + 1 + skip, last_sec - tail  # whole seconds lo .. hi-1
    requests_ps = {}
    for start, _, _ in rows:
        s = start // 1_000_000
        requests_ps[s] = requests_ps.get(s, 0) + 1
    window = [s for s in range(lo, hi)]
    w_requests = sum(requests_ps.get(s, 0) for s in window)
    w_hits = sum(hits_ps.get(s, 0) for s in window)
    w_rows = [r for r in rows if lo <= r[0] // 1_000_000 < hi]

    def ok(status):
        return 200 <= status < 300

    statuses = {}
    for _, status, _ in rows:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    after_first = [r for r in rows if r[0] >= first_us + 1_000_000]
    latencies = sorted(r[2] / 1000 for r in w_rows)  # ms
    p50 = percentile(latencies, 50)
    # the last ten whole seconds before the tail: one full budget window in steady state
    last10 = [s for s in range(max(first_sec + 1, hi - 10), hi)]
    out = {
        "scenario": scenario,
        "proxy": proxy,
        "round": int(opts.get("--round", 1)),
        "seconds": round((last_us - first_us) / 1e6, 2),
        "requests": len(rows),
        "rate": round(len(rows) / max((last_us - first_us) / 1e6, 1e-9), 1),
        "h2load": h2load_counts(os.path.join(d, "h2load.txt")),
        "statuses": statuses,
        "upstream_hits": hits,
        "stalled_attempts": after_stalled - before_stalled,
        "attempts_per_request": round(hits / len(rows), 4),
        # against the requests h2load sent, answered or not (the targets were read after them)
        "extra_upstream_pct": round(100 * (hits - sent) / sent, 3),
        "success": round(sum(ok(r[1]) for r in rows) / len(rows), 6),
        "success_after_1s": round(sum(ok(r[1]) for r in after_first) / max(len(after_first), 1), 6),
        "requests_after_1s": len(after_first),
        "failures_after_1s": sum(not ok(r[1]) for r in after_first),
        "window": {"skip_s": skip, "tail_s": tail, "seconds": len(window), "requests": w_requests,
                   "upstream_hits": w_hits,
                   "attempts_per_request": round(w_hits / w_requests, 4) if w_requests else None,
                   "extra_upstream_pct": round(100 * (w_hits - w_requests) / w_requests, 2)
                   if w_requests else None,
                   "success": round(sum(ok(r[1]) for r in w_rows) / len(w_rows), 6) if w_rows else None,
                   "p50_ms": p50, "p95_ms": percentile(latencies, 95),
                   "p99_ms": percentile(latencies, 99), "p999_ms": percentile(latencies, 99.9),
                   "max_ms": latencies[-1] if latencies else None,
                   "over_3x_p50": sum(1 for x in latencies if p50 and x > 3 * p50),
                   "over_1s": sum(1 for x in latencies if x > 1000)},
        "last_10s": {"seconds": len(last10), "requests": sum(requests_ps.get(s, 0) for s in last10),
                     "upstream_hits": sum(hits_ps.get(s, 0) for s in last10)},
        # attempts per request second by second: what a budget window filling up looks like
        "per_second": [[s - first_sec, requests_ps.get(s, 0), hits_ps.get(s, 0)]
                       for s in range(first_sec, last_sec + 1)],
    }
    metrics = os.path.join(d, "metrics.txt")
    if os.path.exists(metrics):
        with open(metrics) as f:
            out["raahi_metrics"] = [line.strip() for line in f if line.strip()]
    print(json.dumps(out))


def fmt(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def table(path):
    with open(path) as f:
        results = [json.loads(line) for line in f if line.strip()]
    rounds = max(r.get("round", 1) for r in results) if results else 1
    proxies = list(dict.fromkeys(r["proxy"] for r in results))
    results.sort(key=lambda r: (proxies.index(r["proxy"]), r.get("round", 1)))
    for r in results:
        r["label"] = f"{r['proxy']} #{r.get('round', 1)}" if rounds > 1 else r["proxy"]
    by = {}
    for r in results:
        by.setdefault(r["scenario"], []).append(r)
    if "outage" in by:
        print("\n**A. Total outage** (every target answers 503), fixed rate:\n")
        print("| proxy | client req/s | client requests | upstream attempts | attempts / request |"
              " after the first 10 s | last 10 s | client statuses |")
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for r in by["outage"]:
            w, t = r["window"], r["last_10s"]
            last = t["upstream_hits"] / t["requests"] if t["requests"] else None
            print(f"| {r['label']} | {r['rate']:.0f} | {r['requests']:,} | {r['upstream_hits']:,} | "
                  f"**{r['attempts_per_request']:.3f}** | {fmt(w['attempts_per_request'], 3)}"
                  f" ({w['seconds']} s: {w['upstream_hits']:,} / {w['requests']:,}) | {fmt(last, 3)} | "
                  + ", ".join(f"{k}: {v:,}" for k, v in sorted(r["statuses"].items())) + " |")
        print("\nAttempts per request, second by second (the first and last seconds are partial):\n")
        for r in by["outage"]:
            print(f"- {r['label']}: " + " ".join(
                f"{hits / n:.2f}" if n else "-" for _, n, hits in r["per_second"]))
    if "half" in by:
        print("\n**B. Half the targets failing** (503), fixed rate:\n")
        print("| proxy | client requests | success | success after the first second |"
              " failures after 1 s | attempts / request | client statuses |")
        print("|---|---:|---:|---:|---:|---:|---|")
        for r in by["half"]:
            print(f"| {r['label']} | {r['requests']:,} | {100 * r['success']:.2f} % | "
                  f"**{100 * r['success_after_1s']:.3f} %** | {r['failures_after_1s']:,} / "
                  f"{r['requests_after_1s']:,} | {r['attempts_per_request']:.3f} | "
                  + ", ".join(f"{k}: {v:,}" for k, v in sorted(r["statuses"].items())) + " |")
    for name, title in (("calibrate", "Normal latency** (every target answers at once)"),
                        ("stall", "C. One request in 100 stalls 2 s**")):
        if name not in by:
            continue
        print(f"\n**{title}, fixed rate; latency over the window:\n")
        print("| proxy | requests in window | p50 ms | p95 ms | p99 ms | p99 / p50 | p99.9 ms |"
              " max ms | > 3 × p50 | > 1 s | stalled attempts | extra upstream requests (window) |"
              " (whole run) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in by[name]:
            w = r["window"]
            ratio = w["p99_ms"] / w["p50_ms"] if w["p50_ms"] else None
            print(f"| {r['label']} | {w['requests']:,} | {fmt(w['p50_ms'], 3)} | {fmt(w['p95_ms'], 3)} |"
                  f" **{fmt(w['p99_ms'], 3)}** | {fmt(ratio, 1)} | {fmt(w['p999_ms'], 1)} |"
                  f" {fmt(w['max_ms'], 1)} | {w['over_3x_p50']} | {w['over_1s']} | {r['stalled_attempts']} |"
                  f" {fmt(w['extra_upstream_pct'], 2)} % | **{fmt(r['extra_upstream_pct'], 2)} %** |")
    for r in results:
        if r.get("raahi_metrics"):
            print(f"\n{r['scenario']} {r['label']}: " + "; ".join(r["raahi_metrics"]))


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "run":
        run(sys.argv[2:])
    elif len(sys.argv) == 3 and sys.argv[1] == "table":
        table(sys.argv[2])
    else:
        sys.exit(__doc__)
