"""What PT2's own tooling shows of us: structured-trace artifacts and recompile reasons.

* ``read``, one of the ledger's readers (``dynamo/wiring.py`` registers it):
  our ``compiler_collective``, ``guard_collective``, ``compile_once`` and
  ``compiler_collectives_audit`` artifacts in torch's structured trace
  (``TORCH_TRACE``; tlparse shows them), each written from its record
  (``records.py``) as the ledger adds it. The agreements add their records
  inside the compile they belong to, so torch files each artifact under that
  compile. No other module writes one (``tests/unit/test_ledger_readers.py``).
* ``convert_frame.get_and_maybe_log_recompilation_reasons``: after an agreed
  guard miss, every rank's reasons, recorded where Dynamo records its own
  (its ``recompiles`` log, the ``recompile_reasons`` artifact, the metrics).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import torch

from ..agreements import compile_scope, guard, reasons
from ..agreements.audit_record import LEVELS
from ..instrument import artifacts
from ..observations import FrameId
from ..records import AuditExchange, CompilerExchange, OnceGraph, ReasonsExchange
from . import bound

_compiler_log = logging.getLogger("compiler_collectives.compiler")
_once_log = logging.getLogger("compiler_collectives.once")
_audit_log = logging.getLogger("compiler_collectives.audit")


def read(record: object) -> None:
    """The ledger's reader: the artifact ``record`` makes, if any (its payload built only when
    TORCH_TRACE is on)."""
    if isinstance(record, CompilerExchange):
        _compiler_collective(record)
    elif isinstance(record, ReasonsExchange):
        _artifact("guard_collective", _json(lambda: _guard_collective(record)))
    elif isinstance(record, OnceGraph):
        _compile_once(record)
    elif isinstance(record, AuditExchange) and record.agreed:
        _audit(record)


def _artifact(name: str, text: Callable[[], str], **options: Any) -> None:
    """One JSON artifact in torch's structured trace; ``text`` (its JSON) runs only if TORCH_TRACE
    is on. Inside a compile, torch files it under that compile's id (and attempt)."""
    bound.originals["trace_structured"](
        "artifact", metadata_fn=lambda: {"name": name, "encoding": "json"}, payload_fn=text, **options
    )


def _json(payload: Callable[[], Any]) -> Callable[[], str]:
    return lambda: json.dumps(payload(), indent=1)


def _compiler_collective(x: CompilerExchange) -> None:
    """The ``compiler_collective`` artifact and the INFO line for one exchange."""
    built: dict[str, Any] = {}

    def payload() -> dict[str, Any]:
        if not built:
            built.update(
                artifacts.compiler_collective(
                    phase=x.phase,
                    rank=x.rank,
                    frame=x.frame,
                    seq=x.seq,
                    states=x.states,
                    restart=x.restart,
                    restart_why=x.restart_why,
                    bytes_sent=x.bytes_sent,
                    bytes_received=x.bytes_received,
                    rounds=x.rounds,
                    elapsed_s=x.elapsed_s,
                    arrival_spread_s=x.arrival_spread_s,
                    last_rank=x.late_rank,
                )
            )
        return built

    _artifact("compiler_collective", _json(payload))
    level = logging.INFO if x.phase == "trace" else logging.DEBUG
    if _compiler_log.isEnabledFor(level):
        _compiler_log.log(level, "compiler collective #%s: %s", x.seq, artifacts.summary_line(payload()))


def _compile_once(x: OnceGraph) -> None:
    """The ``compile_once`` artifact for one graph this rank finished."""
    record = x.record

    def payload() -> dict[str, Any]:
        return artifacts.compile_once(
            rank=x.rank if x.rank >= 0 else torch.distributed.get_rank(),  # -1: no exchange taken
            seq=record["seq"],
            frame=record["frame"],
            level=record["level"],
            key=record["key"],
            state=record["state"],
            why=record["why"],
            outcome=x.outcome,
            outcome_why=x.outcome_why,
            roles=x.roles,
            bytes_received=x.bytes_in,
            waited_s=x.waited_s,
            elapsed_s=(x.finished_ns - x.started_ns) / 1e9,
        )

    try:
        _artifact("compile_once", _json(payload))
    except Exception as e:  # noqa: BLE001 - the graph is compiled and every exchange taken: only the trace lacks it
        _once_log.warning("compile once #%s: could not write its compile_once artifact: %s", record["seq"], e)


def _guard_collective(x: ReasonsExchange) -> dict[str, Any]:
    """The ``guard_collective`` artifact for one miss every rank agreed on (written on every rank)."""
    return {
        "artifact_version": artifacts.ARTIFACT_VERSION,
        "event": "recompile",
        "seq": x.seq,
        "frame": x.frame,
        "rank": x.rank,
        "world_size": x.world_size,
        "this_rank_missed": x.this_rank_missed,
        # this rank's own guards passed: it recompiles only because others missed
        "forced": not x.this_rank_missed,
        "missed_ranks": sorted(x.missed),
        "reasons_by_rank": {str(r): list(v) for r, v in sorted(x.missed.items())},
        "recorded_reasons": list(x.reasons),
        "bytes_sent": x.bytes_sent,
        "bytes_received": x.bytes_received,
        "rounds": x.rounds,
        "time_ms": round(x.elapsed_s * 1e3, 3),
    }


def _audit(x: AuditExchange) -> None:
    """The ``compiler_collectives_audit`` artifact of one graph the audit let run: every rank's
    summary of each level, and this rank's collectives."""

    def payload() -> str:
        return json.dumps(
            {
                "seq": x.seq,
                "rank": x.rank,
                "frame": x.frame,
                "phase": x.phase,
                "report_only_levels": list(x.report_only),
                "collectives": {
                    lv: [c.render() for g in x.graphs if g.level == lv for c in g.collectives]
                    for lv in LEVELS
                    if any(g.level == lv for g in x.graphs)
                },
                "ranks": [
                    {
                        lv.level: {
                            "graphs": lv.graphs,
                            "collectives": lv.collectives,
                            "collectives_digest": lv.collectives_digest.hex(),
                            "graph_digest": lv.graph_digest.hex(),
                        }
                        for lv in levels
                    }
                    for levels in x.ranks
                ],
            }
        )

    try:
        _artifact("compiler_collectives_audit", payload, expect_trace_id=False)
    except Exception as e:  # noqa: BLE001 - tracing must never fail a compile
        _audit_log.debug("could not emit the audit artifact: %s", e)


@compile_scope.boundary
def recompilation_reasons(cache_entries: Any, frame: Any, backend: Any, skip_logging: bool = False) -> list[str]:
    """Dynamo's recompile reasons; after an agreed guard miss, every rank's, on every rank."""
    original = bound.originals["get_and_maybe_log_recompilation_reasons"]
    miss = None if skip_logging else guard.take_agreed_miss()
    if miss is None:
        found: list[str] = original(cache_entries, frame, backend, skip_logging=skip_logging)
        return found
    seq, missed, pg = miss
    code = frame.f_code
    where = str(FrameId(code.co_name, code.co_filename, code.co_firstlineno))
    # A rank that hit has no failing guard to report; Dynamo would say it
    # cannot find a reason.
    own = original(cache_entries, frame, backend, skip_logging=True) if missed else []
    shared = reasons.exchange(pg, seq=seq, missed=missed, own=own, frame=where)  # its record: the artifact
    _record_recompile_reasons(code, shared.reasons)
    agreed: list[str] = shared.reasons
    return agreed


def _record_recompile_reasons(code: Any, reasons_: list[str]) -> None:
    """Where Dynamo records recompile reasons: its recompile logs and ``recompile_reasons`` artifact.

    The returned list also becomes the compile's metrics ``recompile_reason``
    (its first item), which tlparse shows in the compile's metrics.
    """
    listed = "\n".join("    - " + r.replace("\n", "\n      ") for r in reasons_)
    message = (
        f"Recompiling function {code.co_name} in {code.co_filename}:{code.co_firstlineno} "
        f"with every rank (guard collective); guard failures:\n{listed}"
    )
    torch_of = bound.originals
    if torch_of["is_recompiles_verbose_enabled"]():
        torch_of["recompiles_verbose_log"].debug(message)
    elif torch_of["is_recompiles_enabled"]():
        torch_of["recompiles_log"].debug(message)
    torch_of["trace_structured"](
        "artifact",
        metadata_fn=lambda: {"name": "recompile_reasons", "encoding": "json"},
        # the shape Dynamo writes: one reason as a string, several as a list
        payload_fn=lambda: reasons_[0] if len(reasons_) == 1 else reasons_,
    )
    if bound.current("error_on_recompile"):
        raise torch_of["RecompileError"](message)
