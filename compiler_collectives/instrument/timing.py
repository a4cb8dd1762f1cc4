"""Recording what each collective cost: in-memory samples, a per-rank Chrome trace, an exit summary.

Off unless ``COMPILER_COLLECTIVES_TIMING=1`` or ``COMPILER_COLLECTIVES_TRACE_DIR``
is set (or ``set_enabled(True)``). When off, nothing is recorded.

Everything here is written from the ledger's records (``ledger.py``): ``read``
is one of the ledger's readers (the composition root registers it), and turns
each compiler collective (``CompilerExchange``) and each graph under compile
once (``OnceGraph``) into a sample and an event; the guard channel's record
(``GuardChannelBuilt``) makes the recorder of its rank. The guard collective's
calls are too many for a record each: while a recorder exists, its ``guard``
is the ledger's guard reader (``ledger.read_guards``), so the hook takes its
clock only then.

Trace files (``DIR/rank{N}.json``) use the Chrome trace event JSON array format
(Perfetto, chrome://tracing, the format torch.profiler exports): one complete
("X") event per collective, plus metadata naming the process "rank N". The
array is written incrementally and closed at exit; the format allows a missing
closing bracket, so a crash leaves a loadable file.

Flush policy: a compiler-collective event is flushed at once (they are rare
and the most useful after a crash); guard-collective events are flushed every
``FLUSH_EVERY`` events and whenever one arrives more than ``FLUSH_SECONDS``
after the last flush. A crash loses at most the last ``FLUSH_EVERY - 1``
guard events. An unwritable directory logs one warning and disables the file,
never the job.
"""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing.util
import os
import threading
import time
from typing import Any, TextIO

from .. import config
from ..ledger import ledger
from ..records import CompilerExchange, GuardChannelBuilt, OnceGraph

log = logging.getLogger("compiler_collectives.timing")

FLUSH_EVERY = 64
FLUSH_SECONDS = 1.0

# Epoch-based microseconds, so traces of different ranks line up when merged.
_ns = time.time_ns


class Recorder:
    """Samples per kind and an optional trace file for one rank."""

    def __init__(self, rank: int, world_size: int, trace_dir: str | None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.samples: dict[str, list[float]] = {"compiler": [], "guard": [], "compile_once": []}
        self.bytes: dict[str, int] = {"compiler": 0, "guard": 0, "compile_once": 0}
        self.late_ranks: dict[int, int] = {}
        self._trace_dir = trace_dir
        self._file: TextIO | None = None
        self._unflushed = 0
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()
        self._failed = False
        if trace_dir:
            self._open()

    # -------------------------------------------------------------- file

    def _open(self) -> None:
        assert self._trace_dir is not None
        path = os.path.join(self._trace_dir, f"rank{self.rank}.json")
        try:
            os.makedirs(self._trace_dir, exist_ok=True)
            self._file = open(path, "w", encoding="utf-8")
            self._file.write("[\n")
            self._write_event(
                {"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": f"rank {self.rank}"}}
            )
            self._write_event(
                {
                    "name": "compiler_collectives",
                    "ph": "M",
                    "pid": self.rank,
                    "tid": 0,
                    "args": {"world_size": self.world_size, "rank": self.rank},
                }
            )
            self._write_event(
                {"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0, "args": {"sort_index": self.rank}}
            )
            self._file.flush()
        except OSError as e:
            self._disable_file(f"cannot write trace file {path}: {e}")

    def _disable_file(self, why: str) -> None:
        if not self._failed:
            log.warning("%s; trace recording disabled on rank %d (the job goes on)", why, self.rank)
        self._failed = True
        self._file = None

    def _write_event(self, event: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(event, separators=(",", ":")))
        self._file.write(",\n")

    def _emit(self, event: dict[str, Any], flush_now: bool) -> None:
        if self._file is None:
            return
        with self._lock:
            try:
                self._write_event(event)
                self._unflushed += 1
                now = time.monotonic()
                if flush_now or self._unflushed >= FLUSH_EVERY or now - self._last_flush > FLUSH_SECONDS:
                    self._file.flush()
                    self._unflushed = 0
                    self._last_flush = now
            except (OSError, ValueError) as e:
                self._disable_file(f"writing the trace file failed: {e}")

    def close(self) -> None:
        with self._lock:
            if self._file is None:
                return
            try:
                # An empty instant event absorbs the trailing comma.
                self._file.write(
                    json.dumps({"name": "end", "ph": "i", "s": "p", "pid": self.rank, "tid": 0, "ts": _ns() / 1e3})
                )
                self._file.write("\n]\n")
                self._file.close()
            except (OSError, ValueError):
                pass
            self._file = None

    # -------------------------------------------------------------- events

    def compiler(self, x: CompilerExchange) -> None:
        """One compiler collective, from its record."""
        self.samples["compiler"].append(x.elapsed_s)
        self.bytes["compiler"] += x.bytes_sent + x.bytes_received
        self.late_ranks[x.late_rank] = self.late_ranks.get(x.late_rank, 0) + 1
        self._emit(
            self._span(
                "compiler collective",
                x.started_ns,
                x.elapsed_s,
                {
                    "kind": "compiler",
                    "seq": x.seq,
                    "frame": x.frame,
                    "compile_id": x.compile_id,
                    "bytes_out": x.bytes_sent,
                    "bytes_in": x.bytes_received,
                    "rounds": x.rounds,
                    "phase": x.phase,
                    "restart": x.restart,
                    "arrival_spread_ms": round(x.arrival_spread_s * 1e3, 3),
                    "last_rank": x.late_rank,
                },
            ),
            flush_now=True,
        )

    def guard(self, start_ns: int, duration_s: float, seq: int, hit: bool, agreed: bool) -> None:
        """One guard collective (the ledger's guard reader while this recorder is the current one)."""
        self.samples["guard"].append(duration_s)
        self.bytes["guard"] += 24
        if self._file is not None:
            self._emit(
                self._span(
                    "guard collective",
                    start_ns,
                    duration_s,
                    {"kind": "guard", "seq": seq, "hit": hit, "agreed_hit": agreed, "bytes_out": 24, "bytes_in": 24},
                ),
                flush_now=False,
            )

    def once(self, x: OnceGraph) -> None:
        """One graph under compile once, from its key exchange to its load report, from its record."""
        record = x.record
        duration_s = (x.finished_ns - x.started_ns) / 1e9
        self.samples["compile_once"].append(duration_s)
        self.bytes["compile_once"] += x.bytes_in
        self._emit(
            self._span(
                f"compile once: {record['state']}",
                x.started_ns,
                duration_s,
                {
                    "kind": "compile_once",
                    "seq": record["seq"],
                    "frame": record["frame"],
                    "state": record["state"],
                    "why": record["why"] or "",
                    "source": record["source"],
                    "bytes_in": x.bytes_in,
                },
            ),
            flush_now=True,
        )

    def _span(self, name: str, start_ns: int, duration_s: float, args: dict[str, Any]) -> dict[str, Any]:
        """One Chrome-trace complete event ("X") of this rank."""
        return {
            "name": name,
            "cat": "compiler_collectives",
            "ph": "X",
            "pid": self.rank,
            "tid": 0,
            "ts": start_ns / 1e3,
            "dur": duration_s * 1e6,
            "args": args,
        }

    # -------------------------------------------------------------- summary

    def figures(self) -> dict[str, dict[str, float]]:
        """Per kind: count, total/p50/p90/p99/max in seconds, bytes (what the report shows)."""
        out: dict[str, dict[str, float]] = {}
        for kind, values in self.samples.items():
            if not values:
                continue
            q = quantiles(values)
            out[kind] = {
                "count": len(values),
                "total_s": sum(values),
                "p50_s": q[50],
                "p90_s": q[90],
                "p99_s": q[99],
                "max_s": max(values),
                "bytes": self.bytes[kind],
            }
        return out

    def summary(self) -> str:
        lines = [f"compiler_collectives timing, rank {self.rank}:"]
        lines.append(
            f"  {'kind':<9} {'count':>7} {'total ms':>10} {'p50 ms':>8} {'p90 ms':>8} "
            f"{'p99 ms':>8} {'max ms':>8} {'bytes':>10}"
        )
        for kind, values in self.samples.items():
            if not values:
                continue
            q = quantiles(values)
            lines.append(
                f"  {kind:<9} {len(values):>7} {sum(values) * 1e3:>10.2f} {q[50] * 1e3:>8.3f} "
                f"{q[90] * 1e3:>8.3f} {q[99] * 1e3:>8.3f} {max(values) * 1e3:>8.3f} {self.bytes[kind]:>10}"
            )
        if self.late_ranks:
            worst = sorted(self.late_ranks.items(), key=lambda kv: -kv[1])[:3]
            lines.append("  last to arrive at compiler collectives: " + ", ".join(f"rank {r} ({n}x)" for r, n in worst))
        if len(lines) == 2:
            lines.append("  no collectives ran")
        return "\n".join(lines)


def quantiles(values: list[float]) -> dict[int, float]:
    ordered = sorted(values)
    n = len(ordered)
    return {p: ordered[min(n - 1, round(p / 100 * (n - 1)))] for p in (50, 90, 99)}


# The active recorder, or None when timing is off.
recorder: Recorder | None = None
_forced: bool | None = None
_atexit_registered = False


def read(record: object) -> None:
    """The ledger's reader: a compiler collective's or a graph's event and sample, from its record
    (the first compiler collective, or the guard channel, makes this rank's recorder)."""
    rec = recorder
    if isinstance(record, CompilerExchange):
        rec = rec if rec is not None else ensure(record.rank, record.world_size)
        if rec is not None:
            rec.compiler(record)
    elif isinstance(record, OnceGraph):
        if rec is not None and record.record["seq"] is not None:  # no seq: no exchange was taken
            rec.once(record)
    elif isinstance(record, GuardChannelBuilt):
        ensure(record.rank, record.world_size)


def figures() -> dict[str, dict[str, float]] | None:
    """The current recorder's figures (``Recorder.figures``), None while timing is off."""
    rec = recorder
    return None if rec is None else rec.figures()


def _wanted() -> bool:
    if _forced is not None:
        return _forced
    return config.settings.timing or bool(config.settings.trace_dir)


def ensure(rank: int, world_size: int) -> Recorder | None:
    """Create the recorder for this rank if timing is wanted (called when groups exist)."""
    global recorder, _atexit_registered
    if not _wanted():
        return None
    if recorder is None or recorder.rank != rank:
        if recorder is not None:
            recorder.close()
        recorder = Recorder(rank, world_size, config.settings.trace_dir or None)
        ledger.read_guards(recorder.guard)
        if not _atexit_registered:
            atexit.register(_at_exit)
            # Forked multiprocessing children leave through os._exit, which
            # skips atexit but runs multiprocessing's own finalizers.
            multiprocessing.util.Finalize(None, _at_exit, exitpriority=100)
            _atexit_registered = True
    return recorder


def set_enabled(enabled: bool | None) -> None:
    """Force timing on/off from Python (None: follow the settings)."""
    global _forced, recorder
    _forced = enabled
    if enabled is False and recorder is not None:
        ledger.read_guards(None)
        recorder.close()
        recorder = None
    if enabled:
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        ensure(dist.get_rank() if initialized else 0, dist.get_world_size() if initialized else 1)


def _at_exit() -> None:
    global recorder
    rec = recorder
    if rec is None:
        return
    recorder = None  # atexit and the multiprocessing finalizer may both call us
    ledger.read_guards(None)
    rec.close()
    if config.settings.timing or _forced:
        if not log.handlers and not logging.getLogger("compiler_collectives").handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
        log.info("%s", rec.summary())
