"""The wait protocol: how a host's ranks agree through their segment, call by call.

The segment itself (its layout, creation, checks, removal) is ``segment``;
the kernel sleeps are ``futex``. This module is what the ranks do in the
segment: publish a word, wait for their peers' words, publish and watch the
failure word, and sleep and wake.

**One word carries everything.** A call's word is
``1<<63 | tag<<47 | key<<1 | hit`` with ``tag = 0x10000 | (n & 0xFFFF)`` for
the channel's call number ``n``. A reader accepts a word only when its tag is
the call it waits for, so it can never combine a fresh tag with stale data:
an aligned 64-bit store is seen whole or not at all on x86-64 and AArch64,
and no second store has to become visible in order with it. Weak memory
ordering needs nothing more.

**No overwrites.** Words are double-buffered by call parity. A rank reaches
call n+2 (the parity of call n) only after every rank wrote call n+1, which
each does only after reading all of call n.

**The failure word** (the header's ``segment.HDR_FAIL``) is 0 until a local
rank publishes (``failure_word``): its rank + 1 in the low 32 bits, and the
kind bit ``FAIL_LEFT`` (bit 32) when that rank left the job (its own code
raised while it waited) rather than failed, so that peers say which.

**Waiting** spins briefly, yields the core (``os.sched_yield``) for a
while, then sleeps in the kernel on the awaited word itself (a futex on the
high half of that 64-bit word, which every new call's tag changes). With a
core per rank it spins 400 reads first, with more local ranks than cores
only 8, so that the rank being waited on gets the core. After 1 ms of
yielding it sleeps: the usual small skew never reaches a futex (a wake-up
costs an inter-processor interrupt, dear in a VM: sleeping at once made 4
ranks on 2 cores 1.7x slower), and a rank that waits long (a peer still in
its data loader) stops burning a core. A sleeper raises its byte in the
"asleep" lines first and checks the word once more; a publisher reads those
lines after its store (one 64-bit read for up to 8 local ranks) and makes a
``FUTEX_WAKE`` only when one is raised. Neither side can fence from Python,
so a store and a load can cross and a wake-up be missed: every sleep is
therefore bounded (2 ms), which is also how a sleeper notices its deadline
and its poisoned state. Between sleeps or yields the waiter watches the
failure word (publishing a failure wakes every sleeper), this process's own
poisoned state (set by the heartbeat thread when a rank on another host
reports a failure), its deadline, and every 50 ms whether the ranks it waits
for still exist, read from ``/proc`` and checked against their start time,
so a SIGKILLed peer is noticed within tens of milliseconds and a SIGSTOPped
one is named at the deadline. Where futexes are not available (not Linux on
x86-64 or AArch64) waiting yields until the word arrives.

What a failure means for the job is not decided here: a wait that stops
raises an error saying what it saw (a peer's failure word, a dead peer, this
rank poisoned, the deadline), and the agreements' failure procedure takes it
from there.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

from .. import health
from ..errors import CollectiveTimeoutError, PeerFailureError
from .futex import Futex
from .segment import HDR_FAIL, LINE, Segment, process_identity, result_word, sleeper_words, slot_word

WRITTEN = 1 << 63
TAG_SHIFT = 47
KEY_MASK = (1 << 46) - 1
TAG_BIT = 0x10000

FAIL_LEFT = 1 << 32  # kind bit of the failure word: the rank left the job, it did not fail
_FAIL_RANK = (1 << 32) - 1

SPIN_READS = 400  # about 20-40 µs of reads before the first yield, with a core per rank
SPIN_READS_OVERSUBSCRIBED = 8  # more local ranks than cores: give the core up almost at once
YIELD_S = 1e-3  # then yield this long before sleeping in the kernel (measured: sleeping
# sooner cost 4 ranks on 2 cores 1.7x, each wake-up an IPI in a VM)
SLEEP_S = 0.002  # one futex sleep at most: bounds a missed wake-up
LIVENESS_PERIOD_S = 0.05


def tag(n: int) -> int:
    """The tag of call ``n``: never zero, so an unwritten word matches no call."""
    return TAG_BIT | (n & 0xFFFF)


def failure_word(rank: int, left: bool = False) -> int:
    """The failure word a rank publishes: never zero (zero means no failure)."""
    return (rank + 1) | (FAIL_LEFT if left else 0)


def read_failure_word(word: int) -> tuple[int, bool] | None:
    """(global rank that published, whether it left rather than failed), or None if none did."""
    if not word:
        return None
    return (word & _FAIL_RANK) - 1, bool(word & FAIL_LEFT)


@dataclasses.dataclass(frozen=True)
class Arrival:
    """Rank numbers the exchange needs for its messages."""

    rank: int  # this process's global rank
    local_ranks: tuple[int, ...]  # global rank of each local index
    leader_index: int = 0


class LocalExchange:
    """The protocol over one ``Segment`` beyond the fast path: waiting, results, failures.

    The fast path itself (one store of this rank's word, one load of each
    peer's) is inlined in ``hierarchy.ShmGuardChannel.agree``.
    """

    __slots__ = (
        "_address",
        "_asleep",
        "_describe",
        "_futex",
        "_monotonic",
        "_pids",
        "_result",
        "_spin",
        "_starts",
        "_waker",
        "_yield",
        "_yield_s",
        "index",
        "n",
        "ranks",
        "sleepers",
        "timeout_s",
        "words",
    )

    def __init__(
        self, segment: Segment, index: int, arrival: Arrival, timeout_s: float, describe: Callable[[int], str]
    ) -> None:
        self.words = segment.words
        self.index = index
        self.n = segment.local_ranks
        self.ranks = arrival
        self.timeout_s = timeout_s
        self._result = result_word(self.n)
        peers = [segment.peer(j) for j in range(self.n)]
        self._pids = tuple(p[0] for p in peers)
        self._starts = tuple(p[1] for p in peers)
        self._describe = describe  # call number -> "guard collective #s on rank r" prefix
        self._yield = getattr(os, "sched_yield", lambda: time.sleep(0))
        # Spinning only pays when the rank we wait for has a core of its own.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self._spin = SPIN_READS if self.n <= cores else SPIN_READS_OVERSUBSCRIBED
        self._yield_s = YIELD_S
        self._monotonic = time.monotonic
        self._futex = Futex(SLEEP_S) if Futex.available() else None  # this rank's sleeps
        self._waker = self._futex  # wakes peers whatever ``tune`` does to this rank's own sleeps
        self._asleep = segment.asleep
        self._address = segment.address
        self.sleepers = sleeper_words(self.n)  # a publisher reads these after its store

    def tune(
        self,
        *,
        spin: int | None = None,
        yield_s: float | None = None,
        sleep: bool | None = None,
        sleep_s: float = SLEEP_S,
    ) -> None:
        """Change how this rank waits: benchmarks compare policies side by side, and tests
        lengthen the bound on one sleep to show that a wake-up, not the bound, ends it."""
        if spin is not None:
            self._spin = spin
        if yield_s is not None:
            self._yield_s = yield_s
        if sleep is not None:
            self._futex = Futex(sleep_s) if sleep and Futex.available() else None

    # ------------------------------------------------------------------ per call

    @staticmethod
    def slot_word(index: int) -> int:
        """Word offset of local rank ``index``'s slot; its call-parity words are +0 and +1."""
        return slot_word(index)

    def publish_result(self, n: int, in_step: bool, all_hit: bool) -> None:
        index = self._result + (n & 1)
        self.words[index] = WRITTEN | (tag(n) << TAG_SHIFT) | (2 if in_step else 0) | (1 if all_hit else 0)
        if self.anyone_asleep():
            self.wake(index)

    def publish_failed_result(self, n: int, failed_rank: int) -> None:
        index = self._result + (n & 1)
        self.words[index] = WRITTEN | (tag(n) << TAG_SHIFT) | ((failed_rank + 1) << 3) | 4
        self.wake(index)

    def anyone_asleep(self) -> bool:
        words = self.words
        for i in self.sleepers:
            if words[i]:
                return True
        return False

    def wake(self, index: int) -> None:
        """After a store to word ``index``: wake the local ranks asleep on it."""
        if self._waker is not None:
            self._waker.wake(self._address + 8 * index + 4)

    def wait_result(self, n: int) -> tuple[bool, bool]:
        """Non-leaders on a multi-host job: the leader's (all hit, in step) for call ``n``."""
        index = self._result + (n & 1)
        want = tag(n)
        w = self.words[index]
        if w >> TAG_SHIFT != want:
            w = self.wait(index, want, n)
        if w & 4:
            raise self.failed_elsewhere(n, ((w >> 3) & 0xFFFFFFFF) - 1)
        return bool(w & 2) and bool(w & 1), bool(w & 2)

    def failed_elsewhere(self, n: int, failed_rank: int) -> PeerFailureError:
        # Not marked as a report: the rank named may be one that died without reporting
        # (its host's leader saw it gone); the diagnosis finds out.
        return PeerFailureError(
            f"{self._describe(n)}: rank {failed_rank}, on another host, failed during this guard "
            "collective (its host's leader reported it); that rank's log names the cause.",
            kind="guard",
            rank=self.ranks.rank,
            ranks=(failed_rank,),
        )

    # ------------------------------------------------------------------ waiting

    def wait(self, index: int, want: int, n: int) -> int:
        """Until word ``index`` carries tag ``want``: spin, then yield while watching for failures."""
        words = self.words
        for _ in range(self._spin):
            w = words[index]
            if w >> TAG_SHIFT == want:
                return w
        return self._wait_long(index, want, n)

    def _wait_long(self, index: int, want: int, n: int) -> int:
        words = self.words
        monotonic = self._monotonic
        yield_ = self._yield
        start = monotonic()
        deadline = start + self.timeout_s
        next_check = start + LIVENESS_PERIOD_S
        sleep_from = start + self._yield_s if self._futex is not None else deadline
        now = start
        while True:
            if now < sleep_from:
                yield_()
            else:
                self._sleep(index, want)
            w = words[index]
            if w >> TAG_SHIFT == want:
                return w
            if words[HDR_FAIL]:
                raise self._peer_reported(n)
            if health.latch.first_failure is not None:
                raise self._poisoned(n)
            now = monotonic()
            if now >= next_check:
                next_check = now + LIVENESS_PERIOD_S
                self._check_waited(index, n)
            if now >= deadline:
                raise self._timed_out(index, n)

    def _sleep(self, index: int, want: int) -> None:
        """One bounded futex sleep on the high half of word ``index``, unless it arrived meanwhile."""
        futex = self._futex
        if futex is None:  # ``tune`` turned sleeping off since the wait began
            return
        asleep = self._asleep
        asleep[self.index] = 1  # before the last look, so that a publisher after it wakes us
        w = self.words[index]
        if w >> TAG_SHIFT != want and not self.words[HDR_FAIL]:
            futex.wait(self._address + 8 * index + 4, w >> 32)
        asleep[self.index] = 0

    def _slot_owner(self, index: int) -> int | None:
        """Local index of the slot holding word ``index``; None for the result line (the leader's)."""
        line = index // LINE - 1
        return line if line < self.n else None

    def _check_waited(self, index: int, n: int) -> None:
        owner = self._slot_owner(index)
        waited = [owner] if owner is not None else [self.ranks.leader_index]
        for j in range(self.n):  # a dead rank anywhere on the host stalls us too, via the leader
            if j != self.index and j not in waited:
                waited.append(j)
        for j in waited:
            ident = process_identity(self._pids[j])
            if ident is None or ident[0] in ("Z", "X") or ident[1] != self._starts[j]:
                raise self._dead(j, n)

    # ------------------------------------------------------------------ failures

    def publish_failure(self, rank: int, left: bool = False) -> None:
        """Tell every local rank that this one failed (or, ``left``, left the job): they stop
        waiting at once. The first word published stays: it is what the others raise."""
        if not self.words[HDR_FAIL]:
            self.words[HDR_FAIL] = failure_word(rank, left)
        for j in range(self.n + 1):  # every slot and the result line: wherever a rank may sleep
            for parity in (0, 1):
                self.wake(slot_word(j) + parity)

    def _peer_reported(self, n: int) -> PeerFailureError:
        # A report: the failure procedure replaces these words by the rank's own store report.
        failed, left = read_failure_word(self.words[HDR_FAIL]) or (-1, False)
        if left:
            what = f"rank {failed} left the job (its own code raised while it waited in a guard collective)"
        else:
            what = f"rank {failed} reported a failure on this host's shared-memory channel"
        return PeerFailureError(
            f"{self._describe(n)}: {what} while this rank waited; that rank's own error names the cause.",
            kind="guard",
            rank=self.ranks.rank,
            ranks=(failed,),
            reported_by=(failed,),
            left=left,
        )

    def _poisoned(self, n: int) -> PeerFailureError:
        first = health.latch.first_failure
        return PeerFailureError(
            f"{self._describe(n)}: stopped waiting: {first}",
            kind="guard",
            rank=self.ranks.rank,
            ranks=first.ranks if first is not None else (),
            reported_by=first.reported_by if first is not None else (),
            left=getattr(first, "left", False),
        )

    def _dead(self, j: int, n: int) -> PeerFailureError:
        rank = self.ranks.local_ranks[j]
        return PeerFailureError(
            f"{self._describe(n)}: rank {rank} (pid {self._pids[j]}, same host) exited or was "
            "killed while this rank waited for it; check that rank's log and exit status "
            "(SIGKILL often means the out-of-memory killer).",
            kind="guard",
            rank=self.ranks.rank,
            ranks=(rank,),
        )

    def _timed_out(self, index: int, n: int) -> CollectiveTimeoutError:
        owner = self._slot_owner(index)
        missing = []
        for j in range(self.n):
            if j == self.index:
                continue
            if self.words[slot_word(j) + (n & 1)] >> TAG_SHIFT != tag(n):
                missing.append(j)
        if owner is None and not missing:
            missing = [self.ranks.leader_index]
        notes = []
        for j in missing:
            ident = process_identity(self._pids[j])
            state = "stopped (SIGSTOP or a debugger)" if ident and ident[0] in ("T", "t") else "running"
            notes.append(f"rank {self.ranks.local_ranks[j]} (pid {self._pids[j]}): {state}")
        ranks = tuple(self.ranks.local_ranks[j] for j in missing)
        return CollectiveTimeoutError(
            f"{self._describe(n)} timed out after {self.timeout_s:.0f}s waiting on this host's "
            f"shared-memory channel for {'; '.join(notes) or 'the host leader'}. A rank is stuck, "
            "much slower, or took another code path. Raise COMPILER_COLLECTIVES_TIMEOUT if ranks "
            "legitimately run at very different speeds.",
            kind="guard",
            rank=self.ranks.rank,
            ranks=ranks,
        )
