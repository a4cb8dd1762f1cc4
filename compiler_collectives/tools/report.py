"""`python -m compiler_collectives report DIR`: merge per-rank traces and summarize them.

Reads ``DIR/rank{N}.json`` (written with ``COMPILER_COLLECTIVES_TRACE_DIR``),
writes one merged Chrome trace with a process row per rank, and returns a
printable report: per rank and kind (count, p50, p99, max, total, bytes), the
slowest collectives, and the ranks that arrived last most often.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
from typing import Any

from ..errors import ReportError
from ..instrument.timing import quantiles

_RANK_FILE = re.compile(r"^rank(\d+)\.json$")
KINDS = ("compiler", "guard", "compile_once")


@dataclasses.dataclass
class Traces:
    events: dict[int, list[dict[str, Any]]]  # rank -> collective ("X") events
    metadata: list[dict[str, Any]]
    world_size: int


def _parse_file(path: str) -> list[Any]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise ReportError(f"{path}: file is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as first:
        # The format allows an unterminated array (the rank crashed or is still running).
        repaired = text.rstrip().rstrip(",") + "\n]"
        try:
            data = json.loads(repaired)
        except json.JSONDecodeError:
            raise ReportError(
                f"{path}: line {first.lineno}, column {first.colno}: not valid trace JSON ({first.msg})"
            ) from None
    if isinstance(data, dict) and "traceEvents" in data:
        data = data["traceEvents"]
    if not isinstance(data, list):
        raise ReportError(f"{path}: expected a JSON array of trace events")
    return data


def load(directory: str) -> Traces:
    if not os.path.isdir(directory):
        raise ReportError(f"{directory}: no such directory")
    files = {}
    for name in os.listdir(directory):
        m = _RANK_FILE.match(name)
        if m:
            files[int(m.group(1))] = os.path.join(directory, name)
    if not files:
        raise ReportError(
            f"{directory}: no rank*.json files. Run the job with COMPILER_COLLECTIVES_TRACE_DIR={directory}."
        )
    events: dict[int, list[dict[str, Any]]] = {}
    metadata: list[dict[str, Any]] = []
    world_sizes = set()
    for rank, path in sorted(files.items()):
        rank_events = []
        for index, event in enumerate(_parse_file(path)):
            where = f"{path}: event {index}"
            if not isinstance(event, dict) or "ph" not in event:
                raise ReportError(f"{where}: not a trace event object: {str(event)[:80]}")
            if event["ph"] == "M":
                metadata.append(event)
                if event.get("name") == "compiler_collectives":
                    world = event.get("args", {}).get("world_size")
                    if isinstance(world, int):
                        world_sizes.add(world)
                continue
            if event["ph"] != "X":
                continue
            args = event.get("args")
            if (
                not isinstance(event.get("ts"), (int, float))
                or not isinstance(event.get("dur"), (int, float))
                or not isinstance(args, dict)
                or args.get("kind") not in KINDS
            ):
                raise ReportError(f"{where}: a collective event needs numeric ts/dur and args.kind")
            if event.get("pid") != rank:
                raise ReportError(f"{where}: pid {event.get('pid')} in the file of rank {rank}")
            rank_events.append(event)
        events[rank] = rank_events
    world = max(world_sizes) if world_sizes else max(files) + 1
    missing = sorted(set(range(world)) - set(files))
    if missing:
        raise ReportError(
            f"{directory}: missing trace file(s) for rank(s) {missing} of a {world}-rank job "
            f"(found {sorted(files)}). Did those ranks crash before their first collective, or "
            "write to another directory?"
        )
    return Traces(events=events, metadata=metadata, world_size=world)


def merge(traces: Traces, out_path: str) -> None:
    merged = list(traces.metadata)
    for rank in sorted(traces.events):
        merged.extend(traces.events[rank])
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, f)


def table_rows(traces: Traces) -> list[dict[str, Any]]:
    rows = []
    for rank in sorted(traces.events):
        by_kind: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        for event in traces.events[rank]:
            by_kind[event["args"]["kind"]].append(event)
        for kind in KINDS:
            evs = by_kind.get(kind)
            if not evs:
                continue
            durs = [e["dur"] / 1e3 for e in evs]  # ms
            q = quantiles(durs)
            rows.append(
                {
                    "rank": rank,
                    "kind": kind,
                    "count": len(evs),
                    "p50_ms": q[50],
                    "p99_ms": q[99],
                    "max_ms": max(durs),
                    "total_ms": sum(durs),
                    "bytes": sum(int(e["args"].get("bytes_out", 0)) + int(e["args"].get("bytes_in", 0)) for e in evs),
                }
            )
    return rows


def compile_once_rows(traces: Traces) -> list[tuple[Any, str, list[tuple[int, str, str]]]]:
    """Per graph under compile once: (seq, frame, [(rank, compiled/served/loaded/compiled locally, why)])."""
    graphs: dict[Any, tuple[str, list[tuple[int, str, str]]]] = {}
    for rank in sorted(traces.events):
        for e in traces.events[rank]:
            a = e["args"]
            if a["kind"] == "compile_once":
                _, rows = graphs.setdefault(a.get("seq"), (str(a.get("frame", "?")), []))
                rows.append((rank, str(a.get("state", "?")), str(a.get("why", ""))))
    return [(seq, frame, rows) for seq, (frame, rows) in sorted(graphs.items(), key=lambda kv: str(kv[0]))]


def late_ranks(traces: Traces) -> collections.Counter[int]:
    """How often each rank was the last to arrive at a compiler collective."""
    seen: dict[int, int] = {}
    for rank_events in traces.events.values():
        for e in rank_events:
            args = e["args"]
            if args["kind"] == "compiler" and isinstance(args.get("last_rank"), int):
                seen.setdefault(args.get("seq"), args["last_rank"])
    return collections.Counter(seen.values())


def render(traces: Traces, merged_path: str, slowest: int = 5) -> str:
    lines = [f"{traces.world_size} ranks; merged trace: {merged_path}", ""]
    lines.append(
        f"{'rank':>4} {'kind':<9} {'count':>7} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9} {'total ms':>10} {'bytes':>10}"
    )
    for r in table_rows(traces):
        lines.append(
            f"{r['rank']:>4} {r['kind']:<9} {r['count']:>7} {r['p50_ms']:>9.3f} {r['p99_ms']:>9.3f} "
            f"{r['max_ms']:>9.3f} {r['total_ms']:>10.2f} {r['bytes']:>10}"
        )
    all_events = [e for evs in traces.events.values() for e in evs]
    if all_events:
        lines += ["", f"slowest {min(slowest, len(all_events))} collectives:"]
        for e in sorted(all_events, key=lambda e: -e["dur"])[:slowest]:
            a = e["args"]
            frame = f" frame {a['frame']}" if a.get("frame") else ""
            lines.append(f"  {e['dur'] / 1e3:9.3f} ms  rank {e['pid']}  {a['kind']} #{a.get('seq')}{frame}")
    graphs = compile_once_rows(traces)
    if graphs:
        lines += ["", "compile once, per graph (rank: what it did, why):"]
        for seq, frame, per_rank in graphs:
            lines.append(f"  #{seq} {frame}")
            lines.extend(f"    rank {r}: {state} ({why})" for r, state, why in per_rank)
    late = late_ranks(traces)
    if late:
        lines += [
            "",
            "last to arrive at compiler collectives: " + ", ".join(f"rank {r} ({n}x)" for r, n in late.most_common(5)),
        ]
    return "\n".join(lines)


def run(directory: str, out_path: str | None = None) -> str:
    traces = load(directory)
    out_path = out_path or os.path.join(directory, "merged.json")
    merge(traces, out_path)
    return render(traces, out_path)
