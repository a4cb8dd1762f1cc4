"""Who is to blame when a collective failed: every peer classified, within seconds.

On a failure, ``diagnose`` (``liveness.DIAGNOSIS``) waits briefly for every
peer of the side channel's scope to either report its own failure or be seen
absent (gone, stopped, wedged or silent), then says which ranks are absent
and which are alive but elsewhere (a desync). It reads each peer's heartbeat
record and failure report on the store (``store.board``), for a peer on this
host ``/proc``, and the connections the caller found broken (evidence of
death). ``diagnose_with_deadline`` bounds it: a dead store hangs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from .. import config
from ..store.board import SideChannel
from ..store.calls import bounded
from .liveness import DIAGNOSIS, Liveness, PeerWatch, as_int
from .watch import peer_watch

# The name logs were filtered by before the store had a layer of its own.
log = logging.getLogger("compiler_collectives.watchdog")


@dataclasses.dataclass
class PeerStatus:
    rank: int
    state: str  # "failed", "absent", "alive", "unknown" (``why`` says why, or the store did not answer)
    guard_seq: int | None = None
    compiler_seq: int | None = None
    frame: str | None = None
    silent_s: float | None = None  # how long this rank watched the beat counter stand still
    why: str | None = None  # for "absent" and "unknown": what showed it
    message: str | None = None
    report: dict[str, Any] | None = None  # for "failed": its failure report as the diagnosis ended
    liveness: Liveness | None = None  # the verdict the state was read from (``liveness.judge``)

    def describe(self) -> str:
        where = []
        if self.guard_seq is not None:
            where.append(f"last guard collective #{self.guard_seq}")
        if self.compiler_seq:
            where.append(
                f"last compiler collective #{self.compiler_seq}" + (f" for frame {self.frame}" if self.frame else "")
            )
        at = f" ({', '.join(where)})" if where else ""
        if self.state == "absent":
            return f"rank {self.rank}: absent, {self.why or 'no heartbeat'}{at}"
        if self.state == "alive":
            return f"rank {self.rank}: alive but not in this collective{at}"
        if self.state == "failed":
            return f"rank {self.rank}: failed too{at}"
        return f"rank {self.rank}: unknown ({self.why or 'the store did not answer'})"


@dataclasses.dataclass
class Diagnosis:
    peers: list[PeerStatus]

    @property
    def absent(self) -> list[int]:
        return [p.rank for p in self.peers if p.state == "absent"]

    @property
    def alive_elsewhere(self) -> list[int]:
        return [p.rank for p in self.peers if p.state == "alive"]

    def original_reports(self) -> list[PeerStatus]:
        """Peers that reported a failure they saw themselves (not one relayed from a peer)."""
        return [
            p for p in self.peers if p.state == "failed" and p.report is not None and p.report.get("heard_from") is None
        ]

    def render(self) -> str:
        interesting = [p for p in self.peers if p.state != "failed"]
        return "\n".join("  " + p.describe() for p in interesting)


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def diagnose(
    side: SideChannel, grace_s: float, *, until_absent: bool = False, broken: Mapping[int, str] | None = None
) -> Diagnosis:
    """Classify every peer of ``side`` (``liveness.DIAGNOSIS``); waits up to ``grace_s`` for
    undecided ones (with ``until_absent``, only until some peer is found absent). ``broken``:
    peers whose connection to this rank broke (rank -> what showed it): evidence of their death.
    Store calls on the caller's thread: ``diagnose_with_deadline`` bounds them."""
    broken = broken or {}
    deadline = time.monotonic() + grace_s
    watches: dict[int, PeerWatch] = {}
    decided: dict[int, PeerStatus] = {}
    while True:
        peers = []
        for r in side.peers():
            if r == side.rank:
                continue
            if r in decided:
                peers.append(decided[r])
                continue
            failed, record = side.read_peer(r)
            verdict = watches.setdefault(r, peer_watch(side)).read(record, failed=failed, broken=broken.get(r))
            status = PeerStatus(r, "alive", liveness=verdict.liveness)
            if record is not None:
                status.guard_seq = as_int(record.get("guard_seq"))
                status.compiler_seq = as_int(record.get("compiler_seq"))
                status.frame = _str_or_none(record.get("frame"))
            if verdict.liveness is Liveness.FAILED:
                status.state = "failed"
            elif DIAGNOSIS.gives_up(verdict):
                status.state, status.why, status.silent_s = "absent", verdict.why, verdict.silent_s
            elif verdict.liveness is Liveness.UNKNOWN:  # on another host, without a heartbeat
                status.state, status.why = "unknown", verdict.why
            if status.state in ("failed", "absent"):
                decided[r] = status
            peers.append(status)
        undecided = [p for p in peers if p.state in ("alive", "unknown")]
        left = deadline - time.monotonic()
        if not undecided or left <= 0 or (until_absent and any(p.state == "absent" for p in peers)):
            for p in peers:  # as they read now (a report is updated once its sender diagnosed)
                if p.state == "failed":
                    p.report = side.report(p.rank)
            return Diagnosis(peers)
        time.sleep(min(0.1, left))


def diagnose_with_deadline(
    channel: SideChannel | None,
    deadline_s: float,
    *,
    until_absent: bool = False,
    broken: Mapping[int, str] | None = None,
) -> Diagnosis | None:
    """Run ``diagnose`` for about ``deadline_s``; give up 1.5 s after that (a dead store hangs).

    The margin lets the last round of store reads after the grace finish on a
    loaded host: a diagnosis cut off there is lost, and the error then says
    less than it could.
    """
    if channel is None or config.settings.heartbeat_s <= 0:
        return None
    try:
        return bounded(
            lambda: diagnose(channel, grace_s=max(0.0, deadline_s - 0.5), until_absent=until_absent, broken=broken),
            deadline_s + 1.5,
            "during the diagnosis",
        )
    except Exception as e:  # noqa: BLE001
        log.debug("side-channel diagnosis failed: %s", e)
        return None
