"""What we write into PT2's structured trace (``TORCH_TRACE``, read by ``tlparse``).

Three artifacts, all JSON, each filed under the compile it belongs to:

* ``compiler_collective``: one per exchange (``phase`` "inputs" before the
  first trace, "trace" at its end): every rank's entries, which sizes,
  strides and scalars differ across ranks (so become dynamic) and on which
  ranks, whether Dynamo restarts and why, and what the exchange cost.
* ``guard_collective``: one per recompile the guard collective agreed on,
  on every rank: which ranks missed and each one's guard-failure reason, and
  whether this rank's recompile was forced.
* ``compile_once``: one per graph compile once took part in, on every rank:
  the plan (which ranks compiled, served, loaded or compiled locally), this
  rank's role, source and outcome, the bytes it received and its wait.

Plain data in, plain data out: the ledger's reader in ``dynamo/tooling.py``
writes each artifact from its record (``records.py``) into torch's structured
trace. ``ARTIFACT_VERSION`` changes whenever a field of any of them changes
meaning or disappears. The ``guard_collective`` and audit artifacts are built
there, from their records alone; this module knows only the base modules'
types (``compile_once`` takes each rank's plan as plain (role, source) pairs
for that reason).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from ..observations import DYNAMIC, UNSET, InferStride, LocalState, Marker, SizeEntry

ARTIFACT_VERSION = 1


def _atom(a: Any) -> Any:
    """JSON for one size/stride/scalar atom: an int, "?" (dynamic), null (unset), "S(d)"."""
    if a is DYNAMIC:
        return "?"
    if a is UNSET:
        return None
    if isinstance(a, InferStride):
        return f"S({a.dim})"
    return a


def _part(p: Any) -> Any:
    return _atom(p) if isinstance(p, Marker) else [_atom(a) for a in p]


def entry_json(entry: SizeEntry) -> dict[str, Any]:
    return {"scalar": _atom(entry.scalar), "size": _part(entry.size), "stride": _part(entry.stride)}


def _odd_ones(values: Sequence[Any], ranks: Sequence[int]) -> list[int]:
    """Ranks whose value is not the most common one (ties: the lowest rank's value wins)."""
    counts = Counter(values)
    top = max(counts.values())
    common = next(v for v in values if counts[v] == top)
    return [r for r, v in zip(ranks, values) if v != common]


def _differing(
    name: str, what: str, dim: int | None, ranks: Sequence[int], values: Sequence[Any]
) -> dict[str, Any] | None:
    """One dynamic decision, or None when every rank that has the source agrees."""
    if DYNAMIC in values:
        return {
            "source": name,
            "what": what,
            "dim": dim,
            "values": {str(r): _atom(v) for r, v in zip(ranks, values)},
            "ranks": [r for r, v in zip(ranks, values) if v is DYNAMIC],
            "why": "already dynamic on these ranks",
        }
    if len(set(values)) <= 1:
        return None
    return {
        "source": name,
        "what": what,
        "dim": dim,
        "values": {str(r): _atom(v) for r, v in zip(ranks, values)},
        "ranks": _odd_ones(values, ranks),
        "why": "differs across ranks",
    }


def dynamic_decisions(states: Sequence[LocalState]) -> list[dict[str, Any]]:
    """Every scalar, size dim and stride dim that is not the same static value on every rank.

    ``ranks`` names the ranks that differ from the most common value (or that
    had it dynamic already); ``values`` holds each rank's value. A tensor whose
    number of dims differs, or a source that is a tensor on some ranks and a
    scalar on others, is dynamic as a whole (``dim`` null). Only ranks that saw
    the source count; ``seen_on`` lists them when some did not.
    """
    names: list[str] = []
    for state in states:
        names.extend(n for n in state.automatic_dynamic if n not in names)
    out: list[dict[str, Any]] = []
    for name in names:
        ranks = [r for r, s in enumerate(states) if name in s.automatic_dynamic]
        entries = [states[r].automatic_dynamic[name] for r in ranks]
        found: list[dict[str, Any]] = []
        # Dynamo keeps one entry shape for both: a scalar's size and stride are
        # markers, a tensor's scalar is.
        tensor = [not isinstance(e.size, Marker) for e in entries]
        if len(set(tensor)) > 1:
            found.append(
                {
                    "source": name,
                    "what": "kind",
                    "dim": None,
                    "values": {str(r): ("tensor" if t else "scalar") for r, t in zip(ranks, tensor)},
                    "ranks": _odd_ones(tensor, ranks),
                    "why": "a tensor on some ranks, a scalar on others: dynamic as a whole",
                }
            )
        elif not tensor[0]:
            d = _differing(name, "scalar", None, ranks, [e.scalar for e in entries])
            if d is not None:
                found.append(d)
        else:
            for what in ("size", "stride"):
                parts = [getattr(e, what) for e in entries]
                lengths = [len(p) if isinstance(p, tuple) else -1 for p in parts]
                if len(set(lengths)) > 1 or lengths[0] < 0:
                    if len(set(map(repr, parts))) > 1:
                        found.append(
                            {
                                "source": name,
                                "what": what,
                                "dim": None,
                                "values": {str(r): _part(p) for r, p in zip(ranks, parts)},
                                "ranks": _odd_ones(lengths, ranks),
                                "why": "the number of dims differs across ranks: dynamic as a whole",
                            }
                        )
                    continue
                for dim in range(lengths[0]):
                    d = _differing(name, what, dim, ranks, [p[dim] for p in parts])
                    if d is not None:
                        found.append(d)
        if found and len(ranks) != len(states):
            for d in found:
                d["seen_on"] = ranks
        out.extend(found)
    return out


def compiler_collective(
    *,
    phase: str,
    rank: int,
    frame: str,
    seq: int,
    states: Sequence[LocalState],
    restart: bool | None,
    restart_why: str,
    bytes_sent: int,
    bytes_received: int,
    rounds: int,
    elapsed_s: float,
    arrival_spread_s: float,
    last_rank: int,
) -> dict[str, Any]:
    """The ``compiler_collective`` artifact for one exchange; ``restart`` None for the input exchange."""
    payload: dict[str, Any] = {
        "artifact_version": ARTIFACT_VERSION,
        "phase": phase,
        "frame": frame,
        "seq": seq,
        "rank": rank,
        "world_size": len(states),
        "entries": [{name: entry_json(e) for name, e in s.automatic_dynamic.items()} for s in states],
        "frame_state_fresh": [s.frame_state_fresh for s in states],
        "dynamic": dynamic_decisions(states),
    }
    if restart is not None:
        payload["restart"] = restart
        # torch restarts after every exchange; "skipped" is the one we saved
        payload["restart_skipped"] = not restart
        payload["restart_why"] = restart_why
    payload.update(
        bytes_sent=bytes_sent,
        bytes_received=bytes_received,
        rounds=rounds,
        time_ms=round(elapsed_s * 1e3, 3),
        arrival_spread_ms=round(arrival_spread_s * 1e3, 3),
        last_rank=last_rank,
    )
    return payload


def compile_once(
    *,
    rank: int,
    seq: int | None,
    frame: str,
    level: str,
    key: str | None,
    state: str,
    why: str | None,
    outcome: str,
    outcome_why: str | None,
    roles: Mapping[int, tuple[str, int | None]],
    bytes_received: int,
    waited_s: float,
    elapsed_s: float,
) -> dict[str, Any]:
    """The ``compile_once`` artifact for one graph on one rank.

    ``roles``: every rank's plan (global rank -> (role, source)); empty when no exchange was
    taken (the graph was never looked up in a cache). The other ranks' outcomes are in their own
    artifacts: a rank planned to load reports here whether its lookup hit (``outcome``).
    """
    mine = roles.get(rank, ("local", None))

    def having(role: str) -> list[int]:
        return sorted(r for r, (each, _) in roles.items() if each == role)

    return {
        "artifact_version": ARTIFACT_VERSION,
        "seq": seq,
        "frame": frame,
        "level": level,
        "key": key,
        "rank": rank,
        "world_size": len(roles) or None,  # the ranks that took the graph's exchanges
        # compiled, served, loaded, or compiled locally (a load that missed or was refused too)
        "state": state,
        "why": why,
        "role": mine[0],
        "source": mine[1],
        "outcome": outcome,
        "outcome_why": outcome_why,
        "compiled_by": having("compile"),
        "served_by": having("serve"),
        "loaders": having("load"),
        "compiled_locally": having("local"),
        "plan": {str(r): {"role": each, "source": source} for r, (each, source) in sorted(roles.items())},
        "bytes_received": bytes_received,
        "wait_ms": round(waited_s * 1e3, 3),
        "time_ms": round(elapsed_s * 1e3, 3),
    }


def summary_line(payload: dict[str, Any]) -> str:
    """One line for the INFO log: what became dynamic, the restart decision, the cost."""
    dyn = payload["dynamic"]
    if dyn:
        shown = []
        for d in dyn[:4]:
            where = d["source"] + ("" if d["dim"] is None else f" {d['what']}[{d['dim']}]")
            if d["what"] == "scalar":
                where = d["source"]
            shown.append(f"{where} (ranks {d['ranks']})")
        more = f" and {len(dyn) - 4} more" if len(dyn) > 4 else ""
        what = "dynamic: " + ", ".join(shown) + more
    else:
        what = "nothing differs across ranks"
    restart = ""
    if "restart" in payload:
        restart = "; restart: " + ("yes" if payload["restart"] else "skipped") + f" ({payload['restart_why']})"
    return (
        f"{payload['phase']} exchange for {payload['frame']}: {what}{restart}; "
        f"{payload['bytes_sent']} B out, {payload['bytes_received']} B in, "
        f"{payload['rounds']} round(s), {payload['time_ms']:.3f} ms"
    )
