"""Where the time of a ``jax.profiler`` trace went: total duration per op name on the busiest device timeline.

A trace directory holds ``**/*.trace.json.gz`` (Chrome trace events). Device timelines are the processes
named ``/device:...``; within them several threads overlap (modules, ops, streams), so the summary reads
one: the thread with the most complete events, i.e. the finest grain (ops or kernels). Times are self times:
an event nested in another (a loop's body ops inside the loop) is subtracted from its parent. A trace
without device processes (the CPU backend) falls back to the busiest host thread, Python frames left out.

    python -m benchmarks.trace_summary TRACE_DIR [--top 20]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
from typing import Any


def _latest_trace(path: str) -> str | None:
    files = glob.glob(os.path.join(path, "**", "*.trace.json.gz"), recursive=True)
    return max(files, key=os.path.getmtime) if files else None


def _names(events: list[dict], kind: str) -> dict:
    """``process_name`` (keyed by pid) or ``thread_name`` (keyed by (pid, tid)) metadata."""
    key = (lambda e: e["pid"]) if kind == "process_name" else (lambda e: (e["pid"], e["tid"]))
    return {key(e): e.get("args", {}).get("name", "") for e in events if e.get("ph") == "M" and e["name"] == kind}


def _self_times(events: list[dict]) -> tuple[collections.Counter, collections.Counter]:
    """Per name: the summed duration of its events minus that of events nested directly inside them, and counts."""
    totals: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    stack: list[dict] = []  # the open events enclosing the current one, outermost first
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
            stack.pop()
        if stack:
            totals[stack[-1]["name"]] -= e["dur"]
        totals[e["name"]] += e["dur"]
        counts[e["name"]] += 1
        stack.append(e)
    return totals, counts


def summarize_events(events: list[dict[str, Any]], top: int = 15) -> dict[str, Any]:
    """The busiest timeline's ops by total time: ``{"timeline", "source", "total_ms", "top": [...]}``."""
    processes, threads = _names(events, "process_name"), _names(events, "thread_name")
    device_pids = {pid for pid, name in processes.items() if "/device:" in name}
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if device_pids:
        complete = [e for e in complete if e["pid"] in device_pids]
    else:  # host only: leave out Python frames ($file:line) and the executor's own spans
        complete = [e for e in complete if not e["name"].startswith("$") and "Thunk" not in e["name"]]
    if not complete:
        return {"error": "no complete events in the trace"}
    per_thread = collections.Counter((e["pid"], e["tid"]) for e in complete)
    busiest = per_thread.most_common(1)[0][0]
    totals, counts = _self_times([e for e in complete if (e["pid"], e["tid"]) == busiest])
    total_us = sum(totals.values())
    rows = [
        {"name": name[:160], "ms": us / 1e3, "share": us / total_us if total_us else 0.0, "count": counts[name]}
        for name, us in totals.most_common(top)
    ]
    timeline = f"{processes.get(busiest[0], busiest[0])} / {threads.get(busiest, busiest[1])}"
    return {
        "timeline": timeline,
        "source": "device" if device_pids else "host",
        "total_ms": total_us / 1e3,
        "top": rows,
    }


def summarize_trace(path: str, top: int = 15) -> dict[str, Any]:
    """``summarize_events`` of the newest trace file under ``path``; ``{"error": ...}`` when there is none."""
    trace = _latest_trace(path)
    if trace is None:
        return {"error": f"no *.trace.json.gz under {path}"}
    with gzip.open(trace) as f:
        return summarize_events(json.load(f).get("traceEvents", []), top)


def format_summary(summary: dict[str, Any]) -> str:
    if "error" in summary:
        return summary["error"]
    lines = [f"{summary['timeline']} ({summary['source']}): {summary['total_ms']:.1f} ms in ops"]
    lines += [f"{r['ms']:10.2f} ms {100 * r['share']:5.1f}% {r['count']:7d}  {r['name']}" for r in summary["top"]]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace_dir")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args()
    print(format_summary(summarize_trace(args.trace_dir, args.top)))


if __name__ == "__main__":
    main()
