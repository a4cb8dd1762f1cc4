"""The compiler collective: exchange every rank's LocalState at the end of a preflight.

Plain Python over ``torch.distributed``: the Dynamo seam calls ``exchange``
from inside Dynamo; its result carries the restart decision
(``restart_decision``): whether Dynamo must trace the frame again. Every rank receives every payload and runs the same
validation, so a bad payload, a desync or a "no restart needed" decision comes
out identically on all ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from .. import config, health, torch_view
from ..errors import describe
from ..ledger import ledger
from ..observations import DistributedState, FrameId, LocalState
from ..records import CompilerExchange
from ..transport import groups
from . import exchange as exchange_frame
from . import generation, guard_paths, our_groups, wire
from .phases import INPUTS, TRACE

log = logging.getLogger("compiler_collectives.compiler")


def progress() -> dict[str, Any]:
    """What the heartbeat tells of the compiler collective (a progress source, wired at install)."""
    gen = generation.current()
    return {"compiler_seq": gen.compiler_seq, "frame": gen.compiler_frame}


@dataclasses.dataclass
class Exchange:
    """What one compiler collective produced, identical on every rank (its cost figures are the
    ``CompilerExchange`` record's, in the ledger)."""

    envelopes: list[wire.Envelope]
    states: list[LocalState]
    restart: bool


def exchange(
    ds: DistributedState,
    frame: FrameId,
    pg: Any | None = None,
    *,
    state: LocalState | None = None,
) -> Exchange:
    """Run one compiler collective: every rank's state, in rank order, and the restart decision.

    ``state`` defaults to ``ds.local_state`` (the end of the first trace);
    the input exchange before the trace passes the predicted entries instead.
    """
    health.latch.check("compiler")
    pg = ds.compile_pg if pg is None else pg
    # Global ranks on the wire and in messages; under a scope the group's ranks are a subset.
    members = groups.member_ranks(pg)
    rank, world = members[pg.rank()], pg.size()
    gen = generation.current()
    gen.compiler_seq += 1
    seq = gen.compiler_seq
    gen.compiler_frame = str(frame)
    ds.frame, ds.seq = frame, seq

    def where() -> str:
        return describe("compiler", rank, seq, str(frame))

    start_ns = time.time_ns()
    sent_at = start_ns / 1e9
    sending = ds.local_state if state is None else state
    payload = wire.encode(
        sending,
        rank=rank,
        world_size=world,
        frame=frame,
        seq=seq,
        sent_at=sent_at,
    )
    gathered = exchange_frame.gather(
        pg,
        payload,
        kind="compiler",
        seq=seq,
        frame=str(frame),
        where=where,
        decode=wire.decode,
        check=_same_frame,
        phase=TRACE if state is None else INPUTS,
        profile_as="compiler_collectives.compiler_collective",
    )
    envelopes, payloads, rounds, elapsed = (gathered.envelopes, gathered.payloads, gathered.rounds, gathered.elapsed_s)

    states = [e.state for e in envelopes]
    restart, why = restart_decision(states, ds.early_states, ranks=members) if state is None else (False, "")
    bytes_in = sum(len(p) for p in payloads)
    times = [e.sent_at for e in envelopes]
    spread = max(times) - min(times)
    late_rank = members[max(range(world), key=lambda r: times[r])]
    log.debug(
        "%s: %d bytes out, %d in, %d round(s), %.3f ms, arrival spread %.3f ms (last: rank %d)",
        where(),
        len(payload),
        bytes_in,
        rounds,
        elapsed * 1e3,
        spread * 1e3,
        late_rank,
    )
    phase = "trace" if state is None else "inputs"
    # The ledger's readers write its trace event and its artifact from this record.
    ledger.add(
        CompilerExchange(
            phase=phase,
            rounds=rounds,
            bytes_sent=len(payload),
            bytes_received=bytes_in,
            elapsed_s=elapsed,
            arrival_spread_s=spread,
            late_rank=late_rank,
            seq=seq,
            frame=str(frame),
            rank=rank,
            world_size=world,
            started_ns=start_ns,
            compile_id=torch_view.view.compile_id(),
            restart=restart if state is None else None,
            restart_why=why,
            states=tuple(states),
        )
    )
    return Exchange(envelopes, states, restart)


# Every rank compiled the same frame at the same step.
_same_frame: Callable[[Sequence[wire.Envelope], int], None] = exchange_frame.same_exchange(
    "compiler",
    key=lambda e: (e.frame.key(), e.seq),
    line=lambda e: f"  rank {e.rank}: compiler collective #{e.seq} for frame {e.frame}",
    problem="ranks are compiling different frames or are at different compile counts",
    advice=(
        "No automatic-dynamic decision was applied. Compiler collectives need every rank "
        "to run the same compiled code in the same order (SPMD); look for rank-dependent "
        "control flow around torch.compile'd calls, or turn on guard collectives "
        "(COMPILER_COLLECTIVES_GUARDS=1) if one rank recompiles alone."
    ),
)


def restart_decision(
    states: Sequence[LocalState],
    early_states: Sequence[LocalState] | None = None,
    *,
    ranks: Sequence[int] | None = None,
) -> tuple[bool, str]:
    """Whether Dynamo must trace the frame again after the exchange, and why.

    The first trace decided every source from one of two things:

    * a frame argument exchanged before the trace (``early_states``): from
      the prior frame state joined with every rank's predicted entry. That is
      exactly what the restarted trace would apply, provided every rank's
      prediction equals what Dynamo actually recorded for it (the same
      entries from the same ranks). A source no rank's trace used is moot.
    * any other source: traced as static. Right only if every rank saw the
      same sources with the same values and no rank's prior frame state holds
      anything else.

    ``states`` and ``early_states`` are identical on every rank, so every
    rank reaches the same answer, and the same explanation.
    """
    if not config.settings.skip_needless_restart:
        return True, "COMPILER_COLLECTIVES_SKIP_NEEDLESS_RESTART=0: always restart, as torch does"
    named = list(ranks) if ranks is not None else list(range(len(states)))  # global rank of each state
    early_names: set[str] = set()
    if early_states is not None:
        for early in early_states:
            early_names.update(early.automatic_dynamic)
        for name in sorted(early_names):
            if not any(name in s.automatic_dynamic for s in states):
                continue
            for rank, (s, e) in enumerate(zip(states, early_states)):
                recorded, predicted = s.automatic_dynamic.get(name), e.automatic_dynamic.get(name)
                if recorded != predicted:
                    return True, (
                        f"rank {named[rank]}'s trace recorded {name} as {_shown(recorded)} but its "
                        f"exchanged argument was {_shown(predicted)}"
                    )

    def rest(state: LocalState) -> dict[str, Any]:
        return {k: v for k, v in state.automatic_dynamic.items() if k not in early_names}

    first = rest(states[0])
    for rank, s in enumerate(states):
        if not s.frame_state_fresh:
            return True, (
                f"rank {named[rank]}'s frame state from earlier compiles could change a decision "
                "for a source outside the frame's arguments"
            )
        other = rest(s)
        if other != first:
            name = min(n for n in set(first) | set(other) if first.get(n) != other.get(n))
            return True, (
                f"{name}, which is not a frame argument and was traced as static, differs: "
                f"rank {named[0]} recorded {_shown(first.get(name))}, rank {named[rank]} {_shown(other.get(name))}"
            )
    if early_names:
        return False, (
            "every rank's trace recorded its frame arguments exactly as exchanged before "
            "the trace, and the same values for every other source"
        )
    return False, "every rank recorded the same sources with the same values"


def _shown(entry: Any) -> str:
    return "nothing" if entry is None else entry.render()


def group_for_compile() -> Any:
    return our_groups.compile_pg()


def distributed() -> bool:
    """Whether a default process group exists (else there is nobody to agree with), and
    this rank is not apart from its peers inside one call (``guard_paths.paths_diverged``)."""
    return groups.available() and not guard_paths.apart()
