"""A side channel on the c10d store that lets a failing rank name the ranks to blame.

Gloo tells a survivor that "the connection was reset" or "a recv timed out",
but not which rank is gone. This module keeps, under the key prefix
``compiler_collectives/<generation>/`` of the default store:

* ``join/<name>/<rank>``: our own rendezvous before each group is created,
  bounded by ``COMPILER_COLLECTIVES_TIMEOUT``, so a rank that never comes is
  named instead of blocking group creation for torch's 30-minute default;
* ``hb/<rank>``: a heartbeat every ``COMPILER_COLLECTIVES_HEARTBEAT_S`` seconds
  from a daemon thread, carrying the rank's progress (guard-collective number,
  compiler-collective number and frame). The hot path writes nothing: the
  thread reads counters the collectives keep anyway;
* ``fail/<rank>`` and the counter ``failures``: a failing rank's report. The
  heartbeat thread of every rank watches the counter, so a rank that was
  stopped or slow learns of the failure and refuses further collectives.

On a failure, ``diagnose`` waits briefly for every peer to either report its
own failure or let its heartbeat go stale, then says which ranks are absent
(stale heartbeat: crashed, killed, stopped) and which are alive but elsewhere
(a different collective number: a desync).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from . import config

log = logging.getLogger("compiler_collectives.watchdog")


@dataclasses.dataclass
class PeerStatus:
    rank: int
    state: str  # "failed", "absent", "alive", "unknown"
    guard_seq: int | None = None
    compiler_seq: int | None = None
    frame: str | None = None
    heartbeat_age_s: float | None = None
    message: str | None = None

    def describe(self) -> str:
        where = []
        if self.guard_seq is not None:
            where.append(f"last guard collective #{self.guard_seq}")
        if self.compiler_seq:
            where.append(f"last compiler collective #{self.compiler_seq}"
                         + (f" for frame {self.frame}" if self.frame else ""))
        at = f" ({', '.join(where)})" if where else ""
        if self.state == "absent":
            age = f"{self.heartbeat_age_s:.1f}s" if self.heartbeat_age_s is not None else "ever"
            return f"rank {self.rank}: absent, no heartbeat for {age} (crashed, killed or stopped){at}"
        if self.state == "alive":
            return f"rank {self.rank}: alive but not in this collective{at}"
        if self.state == "failed":
            return f"rank {self.rank}: failed too{at}"
        return f"rank {self.rank}: unknown (the store did not answer)"


@dataclasses.dataclass
class Diagnosis:
    peers: list[PeerStatus]

    @property
    def absent(self) -> list[int]:
        return [p.rank for p in self.peers if p.state == "absent"]

    @property
    def alive_elsewhere(self) -> list[int]:
        return [p.rank for p in self.peers if p.state == "alive"]

    def render(self) -> str:
        interesting = [p for p in self.peers if p.state != "failed"]
        return "\n".join("  " + p.describe() for p in interesting)


class SideChannel:
    """One per generation of our groups (a new default group starts a new one)."""

    def __init__(self, rank: int, world: int, generation: int,
                 progress: Callable[[], dict[str, Any]]) -> None:
        self.rank = rank
        self.world = world
        self.store = dist.PrefixStore(f"compiler_collectives/{generation}/", dist.distributed_c10d._get_default_store())
        self._progress = progress
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_peer_failure: Callable[[int, str], None] | None = None
        self._seen_failures = 0

    # ------------------------------------------------------------ rendezvous

    def rendezvous(self, name: str, timeout_s: float) -> list[int]:
        """Wait until every rank reached ``name``; returns the absent ranks ([] on success)."""
        self.store.set(f"join/{name}/{self.rank}", "1")
        keys = [f"join/{name}/{r}" for r in range(self.world)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=timeout_s))
            return []
        except Exception:  # noqa: BLE001 - c10d raises DistStoreError/RuntimeError
            return [r for r, key in enumerate(keys) if not self.store.check([key])]

    # ------------------------------------------------------------ heartbeat

    def start(self, on_peer_failure: Callable[[int, str], None]) -> None:
        self._on_peer_failure = on_peer_failure
        interval = config.settings.heartbeat_s
        if interval <= 0 or self._thread is not None:
            return
        self._beat()
        self._thread = threading.Thread(
            target=self._run, args=(interval,), name="compiler_collectives-heartbeat", daemon=True
        )
        self._thread.start()

    def stop(self, join_s: float = 0.0) -> None:
        """Stop the heartbeat; with ``join_s``, wait that long for the thread to finish."""
        self._stop.set()
        thread = self._thread
        if join_s > 0 and thread is not None and thread is not threading.current_thread():
            thread.join(join_s)

    def _beat(self) -> None:
        record = dict(self._progress())
        record["t"] = time.time()
        self.store.set(f"hb/{self.rank}", json.dumps(record))

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self._beat()
                failures = self.store.add("failures", 0)
                if failures > self._seen_failures:
                    self._seen_failures = failures
                    self._notice_failures()
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return

    def _notice_failures(self) -> None:
        for r in range(self.world):
            if r == self.rank:
                continue
            key = f"fail/{r}"
            if self.store.check([key]):
                report = json.loads(self.store.get(key))
                if self._on_peer_failure is not None:
                    self._on_peer_failure(r, report.get("message", ""))
                return

    # ------------------------------------------------------------ failures

    def report_failure(self, kind: str, seq: int | None, message: str) -> None:
        self.store.set(f"fail/{self.rank}", json.dumps({"kind": kind, "seq": seq, "message": message[:2000]}))
        self.store.add("failures", 1)

    def _peer(self, r: int, stale_after: float, now: float) -> PeerStatus:
        if self.store.check([f"fail/{r}"]):
            status = PeerStatus(r, "failed")
        elif not self.store.check([f"hb/{r}"]):
            return PeerStatus(r, "absent")
        else:
            status = PeerStatus(r, "alive")
        if self.store.check([f"hb/{r}"]):
            beat = json.loads(self.store.get(f"hb/{r}"))
            status.heartbeat_age_s = max(0.0, now - float(beat.get("t", 0.0)))
            status.guard_seq = beat.get("guard_seq")
            status.compiler_seq = beat.get("compiler_seq")
            status.frame = beat.get("frame")
            if status.state == "alive" and status.heartbeat_age_s > stale_after:
                status.state = "absent"
        return status

    def diagnose(self, grace_s: float) -> Diagnosis:
        """Classify every peer; waits up to ``grace_s`` for undecided ones."""
        interval = config.settings.heartbeat_s
        stale_after = 2.5 * interval + 0.5
        deadline = time.monotonic() + grace_s
        while True:
            now = time.time()
            peers = [self._peer(r, stale_after, now) for r in range(self.world) if r != self.rank]
            undecided = [p for p in peers if p.state == "alive"]
            if not undecided or time.monotonic() >= deadline:
                return Diagnosis(peers)
            time.sleep(0.1)


def diagnose_with_deadline(channel: SideChannel | None, deadline_s: float) -> Diagnosis | None:
    """Run ``channel.diagnose`` but never block longer than ``deadline_s`` (a dead store hangs)."""
    if channel is None or config.settings.heartbeat_s <= 0:
        return None
    result: list[Diagnosis] = []

    def work() -> None:
        try:
            result.append(channel.diagnose(grace_s=max(0.0, deadline_s - 0.5)))
        except Exception as e:  # noqa: BLE001
            log.debug("side-channel diagnosis failed: %s", e)

    t = threading.Thread(target=work, name="compiler_collectives-diagnose", daemon=True)
    t.start()
    t.join(deadline_s)
    return result[0] if result else None
