"""What PT2's own tooling shows of us: structured-trace artifacts and recompile reasons.

* ``torch._logging.trace_structured``: our ``compiler_collective``,
  ``guard_collective`` and ``compile_once`` artifacts in ``TORCH_TRACE``
  (tlparse shows them), filed under the compile they belong to.
* ``convert_frame.get_and_maybe_log_recompilation_reasons``: after an agreed
  guard miss, every rank's reasons, recorded where Dynamo records its own
  (its ``recompiles`` log, the ``recompile_reasons`` artifact, the metrics).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from ..agreements import compile_scope, guard, once, reasons
from ..instrument import artifacts
from ..observations import DistributedState, FrameId
from . import bound

_compiler_log = logging.getLogger("compiler_collectives.compiler")
_once_log = logging.getLogger("compiler_collectives.once")


def structured_artifact(name: str, payload_fn: Callable[[], Any]) -> None:
    """A JSON artifact in torch's structured trace; ``payload_fn`` runs only if TORCH_TRACE is on.

    Inside a compile, torch files it under that compile's id (and attempt).
    """
    bound.originals["trace_structured"](
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "json"},
        payload_fn=lambda: json.dumps(payload_fn(), indent=1),
    )


def trace_exchange(result: Any, ds: DistributedState) -> None:
    """The ``compiler_collective`` artifact and the INFO line for one exchange."""
    built: dict[str, Any] = {}
    # Read now: the box lets go of its group when the compile ends (``DistributedState.end``).
    rank = result.envelopes[ds.compile_pg.rank()].rank  # global rank, under a scope too
    frame, seq = str(ds.frame), ds.seq or 0

    def payload() -> dict[str, Any]:
        if not built:
            times = [e.sent_at for e in result.envelopes]
            built.update(
                artifacts.compiler_collective(
                    phase=result.phase,
                    rank=rank,
                    frame=frame,
                    seq=seq,
                    states=result.states,
                    restart=None if result.phase == "inputs" else result.restart,
                    restart_why=result.restart_why,
                    bytes_sent=result.bytes_sent,
                    bytes_received=result.bytes_received,
                    rounds=result.rounds,
                    elapsed_s=result.elapsed_s,
                    arrival_spread_s=max(times) - min(times),
                    last_rank=result.envelopes[max(range(len(times)), key=lambda r: times[r])].rank,
                )
            )
        return built

    structured_artifact("compiler_collective", payload)
    level = logging.INFO if result.phase == "trace" else logging.DEBUG
    if _compiler_log.isEnabledFor(level):
        _compiler_log.log(level, "compiler collective #%s: %s", ds.seq, artifacts.summary_line(payload()))


def trace_once(ticket: once.Ticket, record: dict[str, Any]) -> None:
    """The ``compile_once`` artifact for one graph this rank finished (``once.set_on_record``)."""
    # Called as the graph's last exchange ended, inside its compile: torch files it there.
    rank = ticket.rank if ticket.rank >= 0 else torch.distributed.get_rank()  # -1: no exchange taken
    finished_ns = time.time_ns()

    def payload() -> dict[str, Any]:
        return artifacts.compile_once(
            rank=rank,
            seq=ticket.seq,
            frame=str(ticket.frame),
            level=ticket.level,
            key=ticket.key,
            state=record["state"],
            why=record["why"],
            outcome=ticket.outcome,
            outcome_why=ticket.outcome_why,
            roles={r: (p.role, p.source) for r, p in ticket.plans.items()},
            bytes_received=ticket.bytes_in,
            waited_s=ticket.waited_s,
            elapsed_s=(finished_ns - ticket.started_ns) / 1e9,
        )

    try:
        structured_artifact("compile_once", payload)
    except Exception as e:  # noqa: BLE001 - the graph is compiled and every exchange taken: only the trace lacks it
        _once_log.warning("compile once #%s: could not write its compile_once artifact: %s", ticket.seq, e)


def guard_collective(shared: reasons.Shared, frame: str | None) -> dict[str, Any]:
    """The ``guard_collective`` artifact for one miss every rank agreed on (emitted on every rank)."""
    return {
        "artifact_version": artifacts.ARTIFACT_VERSION,
        "event": "recompile",
        "seq": shared.seq,
        "frame": frame,
        "rank": shared.rank,
        "world_size": shared.world_size,
        "this_rank_missed": shared.this_rank_missed,
        # this rank's own guards passed: it recompiles only because others missed
        "forced": not shared.this_rank_missed,
        "missed_ranks": sorted(shared.missed),
        "reasons_by_rank": {str(r): v for r, v in sorted(shared.missed.items())},
        "recorded_reasons": shared.reasons,
        "bytes_sent": shared.bytes_sent,
        "bytes_received": shared.bytes_received,
        "rounds": shared.rounds,
        "time_ms": round(shared.elapsed_s * 1e3, 3),
    }


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
    shared = reasons.exchange(pg, seq=seq, missed=missed, own=own, frame=where)
    structured_artifact("guard_collective", lambda: guard_collective(shared, where))
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


def emit_artifact(name: str, payload_fn: Callable[[], str]) -> None:
    """An artifact whose payload is already JSON text (the audit's summaries)."""
    bound.originals["trace_structured"](
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "json"},
        payload_fn=payload_fn,
        expect_trace_id=False,
    )
