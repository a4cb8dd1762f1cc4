"""The guard collective across hosts: shared memory within a host, one leader per host.

``build_guard_channel`` runs once per generation of our groups, on every rank
together, and picks the guard mechanism (``COMPILER_COLLECTIVES_GUARD_TRANSPORT``):

1. Every rank computes its host key (hostname, boot id, and the torchrun
   agent's ``GROUP_RANK`` when set, so two agents on one machine are two
   hosts) and whether it can use shared memory at all; one all-gather on the
   guard group shares both.
   The same all-gather carries each rank's pid and a random token, from
   which every rank computes the name of its leader's segment.
2. Each host's lowest rank (its leader) first removes segments that dead
   jobs left behind (``segment.remove_leaked_segments``), then creates its segment
   under that name and publishes the name on the c10d store; the others map
   it only if the store names exactly the segment they computed and the file
   passes ``segment.Segment.open``'s checks, and register in their slots. The
   store is reachable by any client that can reach its port, so a name read
   from it is never opened as given, and never unlinked. Once every local
   rank has reported, each checks that it sees every peer's slot and process
   (the probe), and the segment's name is unlinked by its creator and by
   every rank that verified it: nothing is left in /dev/shm whatever happens
   later.
3. A second all-gather shares the probe results. If any rank cannot use
   shared memory, every rank falls back to the gloo all-reduce, and rank 0
   logs one line saying why.
4. With several hosts, the leaders get a gloo group of their own.

Per call, every rank writes one word into its host's segment. On one host
every rank reads every word and decides alone, from the same data. Across
hosts the leader reads its host's words, runs a MIN all-reduce of two int64
with the other leaders by recursive doubling (ceil(log2 H) rounds of gloo
send/recv, two more when H is not a power of two), and publishes the outcome
in its segment.
"""

from __future__ import annotations

import ctypes
import datetime
import hashlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import config, health
from ..errors import CollectiveError, PeerFailureError, StoreUnresponsive, describe
from ..store.calls import bounded
from . import segment, shm
from .channel import GuardChannel
from .gloo import GlooGuardChannel, is_connection_failure, started, wait
from .probes import close_connections

log = logging.getLogger("compiler_collectives.transport.hierarchy")

_GOLDEN = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1
_WRITTEN, _TAG_SHIFT, _KEY_MASK, _TAG_BIT = shm.WRITTEN, shm.TAG_SHIFT, shm.KEY_MASK, shm.TAG_BIT


def host_key() -> int:
    """A 63-bit id equal on ranks of one machine under one torchrun agent."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = ""
    text = f"{socket.gethostname()}|{boot}|{os.environ.get('GROUP_RANK', '')}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _MASK63


def _all_gather_ints(pg: dist.ProcessGroup, values: list[int]) -> list[list[int]]:
    mine = torch.tensor(values, dtype=torch.int64)
    out = [torch.zeros(len(values), dtype=torch.int64) for _ in range(pg.size())]
    wait(started(pg.allgather, [out], [mine]))
    return [t.tolist() for t in out]


def doubling_plan(index: int, hosts: int) -> tuple[tuple[str, int, int], ...]:
    """Leader ``index``'s steps of a recursive-doubling all-reduce among ``hosts`` leaders:
    (op, peer, tag), op one of give/take (a leader past the largest power of two P <= H hands
    its value to ``index - P`` and takes the result back), fold/tell (its partner's side) and
    swap (exchange and fold). Partners use the same tag, so tags name the phase."""
    p = 1
    while p * 2 <= hosts:
        p *= 2
    last = p.bit_length()
    plan: list[tuple[str, int, int]] = []
    if index >= p:
        return (("give", index - p, 0), ("take", index - p, last))
    if index + p < hosts:
        plan.append(("fold", index + p, 0))
    step, k = 1, 1
    while step < p:
        plan.append(("swap", index ^ step, k))
        step, k = step * 2, k + 1
    if index + p < hosts:
        plan.append(("tell", index + p, last))
    return tuple(plan)


class LeaderExchange:
    """MIN all-reduce of two int64 among host leaders, by recursive doubling over send/recv.

    With H leaders and P the largest power of two <= H, leader ``i >= P``
    first gives its pair to ``i - P`` and at the end takes the result from it;
    the P others swap with ``i ^ 2^k`` for each k, folding in what they get.
    Buffers and ctypes views are made once, here.

    Its waits are untimed (gloo's own bound: the leaders' group timeout,
    ``COMPILER_COLLECTIVES_TIMEOUT``). A timed wait on a gloo send or receive
    that expires closes every connection of the group (``hosttree``'s
    docstring), and a leader waits here for other hosts still compiling or
    running user code; a helper thread per call, as compile once's exchanges
    take, would cost the guard's fast path tens of microseconds. A failure
    this rank hears of while it waits here ends the wait instead
    (``interrupt``, from the heartbeat thread that heard it: the group is
    of no further use to a poisoned rank, and its connections are closed).
    A leader whose connection closes that way, and who has not heard of the
    failure yet, waits about a heartbeat for it before it blames the peer.
    """

    __slots__ = ("_plan", "_recv", "_recv_view", "_send", "_send_view", "hosts", "index", "pg", "waiting")

    def __init__(self, pg: dist.ProcessGroup, index: int, hosts: int) -> None:
        self.pg = pg
        self.index = index
        self.hosts = hosts
        self._plan = doubling_plan(index, hosts)
        self._send = torch.zeros(2, dtype=torch.int64)
        self._recv = torch.zeros(2, dtype=torch.int64)
        self._send_view = (ctypes.c_int64 * 2).from_address(self._send.data_ptr())
        self._recv_view = (ctypes.c_int64 * 2).from_address(self._recv.data_ptr())
        self.waiting = False  # inside ``min2``: ``interrupt`` ends its wait

    @property
    def rounds(self) -> int:
        return len(self._plan)

    def min2(self, a: int, b: int) -> tuple[int, int]:
        self.waiting = True
        # After ``waiting`` is set: a failure heard from now on interrupts the wait below.
        if health.latch.first_failure is not None:
            self.waiting = False
            raise _stopped(health.latch.first_failure)
        send, recv = self._send_view, self._recv_view
        send_list, recv_list = [self._send], [self._recv]
        pg = self.pg
        try:
            for op, peer, tag in self._plan:
                if op in ("give", "tell", "swap"):
                    send[0], send[1] = a, b
                    sent = pg.send(send_list, peer, tag)
                    if op != "swap":
                        sent.wait()
                        continue
                pg.recv(recv_list, peer, tag).wait()
                if op == "swap":
                    sent.wait()
                if op == "take":
                    a, b = recv[0], recv[1]
                else:
                    a, b = min(a, recv[0]), min(b, recv[1])
        except RuntimeError as e:
            self.waiting = False
            raise _failed(e) from e
        self.waiting = False
        return a, b

    def interrupt(self) -> None:
        """End a ``min2`` that waits now (any thread; this rank heard of a failure): close this
        rank's connections in the leaders' group (``probes.close_connections``)."""
        if self.waiting:
            close_connections(self.pg)


def _stopped(failure: CollectiveError) -> PeerFailureError:
    # As ``gloo.wait`` says it: keeps who reported it, so the failure procedure quotes that report.
    where = f"{describe('guard', None, None, None)}: the exchange between hosts' leaders stopped waiting"
    return PeerFailureError.stopped_waiting(where, failure)


REPORT_WAIT_HEARTBEATS = 2.5
"""How long a leader whose connection closed waits for a failure report before it blames the
peer (in heartbeats, plus a second): a leader that heard of a failure closes its connections."""


def _failed(error: RuntimeError) -> BaseException:
    """What ``min2`` raises after gloo's ``error``: a failure this rank heard of, where it heard
    of one (now, or within about a heartbeat where a connection closed: a peer leader that heard of
    it first closed its connections); else gloo's own (the guard hook translates it)."""
    heard = health.latch.first_failure
    interval = config.settings.heartbeat_s
    if heard is None and interval > 0 and is_connection_failure(error):
        deadline = time.monotonic() + REPORT_WAIT_HEARTBEATS * interval + 1.0
        while heard is None and time.monotonic() < deadline:
            time.sleep(0.02)
            heard = health.latch.first_failure
    return _stopped(heard) if heard is not None else error


class ShmGuardChannel:
    """The guard collective on shared memory, with leaders between hosts.

    A ``GuardChannel`` (``channel``), as ``GlooGuardChannel`` is: ``agree`` for
    the fast path, ``describe_all`` for the slow path (over ``pg``, the gloo
    guard group of every rank), ``publish_failure`` for the failure procedure.
    """

    __slots__ = (
        "_asleep",
        "_leaders",
        "_local",
        "_many",
        "_mine",
        "_multi_host",
        "_n",
        "_peers",
        "_words",
        "check_desync",
        "hosts",
        "leaders_pg",
        "local_ranks",
        "name",
        "pg",
    )

    def __init__(
        self,
        pg: dist.ProcessGroup,
        local_ranks: int,
        exchange: shm.LocalExchange,
        hosts: int,
        leaders: LeaderExchange | None,
        leaders_pg: Any = None,
    ) -> None:
        self.pg = pg
        self.leaders_pg = leaders_pg  # the leaders' gloo group (every rank took part in creating it)
        self.check_desync = True  # free here: the frame id rides in the same word
        self.hosts = hosts
        self.local_ranks = local_ranks
        self.name = "shm" if hosts == 1 else "shm+leaders"
        self._n = 0
        self._local = exchange
        self._leaders = leaders  # this rank's exchange with other leaders, if it leads a host
        self._multi_host = hosts > 1
        # The fast path below inlines shm.encode / LocalExchange.publish and gather:
        # each Python call saved is a tenth of a microsecond on every compiled call.
        self._words = exchange.words
        self._mine = exchange.slot_word(exchange.index)
        self._peers = tuple(exchange.slot_word(j) for j in range(local_ranks) if j != exchange.index)
        # Ranks that wait long sleep on a futex; one word covers the "asleep" bytes of 8 local ranks.
        self._asleep = exchange.sleepers[0]
        self._many = len(exchange.sleepers) > 1

    def agree(self, hit: bool, seq: int, site: int = 0) -> tuple[bool, bool]:
        """Returns (every rank hit, every rank at the same call of the same frame)."""
        n = self._n = self._n + 1
        parity = n & 1
        # The word format is in shm's docstring: 1<<63 | tag<<47 | key<<1 | hit.
        want = _TAG_BIT | (n & 0xFFFF)
        word = _WRITTEN | (want << _TAG_SHIFT) | ((((site * _GOLDEN) ^ seq) & _KEY_MASK) << 1) | (1 if hit else 0)
        words = self._words
        words[self._mine + parity] = word
        if words[self._asleep] or (self._many and self._local.anyone_asleep()):
            self._local.wake(self._mine + parity)
        if self._multi_host and self._leaders is None:
            return self._local.wait_result(n)
        lo = hi = word
        for base in self._peers:
            w = words[base + parity]
            if w >> _TAG_SHIFT != want:
                w = self._gather_slow(base + parity, want, n)
            if w < lo:
                lo = w
            elif w > hi:
                hi = w
        if not self._multi_host:
            in_step = (lo >> 1) == (hi >> 1)
            return in_step and bool(lo & 1), in_step
        # Multi-host, not returned above: this rank leads its host, so _leaders is set. Read as
        # is (no local, no assert): the single-host path above must not pay for the narrowing.
        a, b = self._leaders.min2(lo & _MASK63, -(hi & _MASK63))  # type: ignore[union-attr]
        local = self._local
        if a < 0:  # a leader elsewhere reported a failure in place of its host's words
            local.publish_failed_result(n, -a - 1)
            raise local.failed_elsewhere(n, -a - 1)
        in_step = (a >> 1) == ((-b) >> 1)
        all_hit = in_step and bool(a & 1)
        local.publish_result(n, in_step, all_hit)
        return all_hit, in_step

    @property
    def exchange(self) -> shm.LocalExchange:
        """This host's shared-memory exchange (benchmarks tune how it waits)."""
        return self._local

    def _gather_slow(self, index: int, want: int, n: int) -> int:
        try:
            return self._local.wait(index, want, n)
        except CollectiveError as e:
            leaders = self._leaders
            if leaders is not None:
                _tell_other_hosts(leaders, e, self._local.ranks.rank)
            raise

    def describe_all(self, seq: int, site: int) -> list[tuple[int, int]]:
        """Slow path after a mismatch (every rank takes it): each rank's (seq, site)."""
        return [(s, f) for s, f in _all_gather_ints(self.pg, [seq, site])]

    def publish_failure(self, rank: int, left: bool = False) -> None:
        self._local.publish_failure(rank, left)

    def interrupt(self) -> None:
        """This rank heard of a failure: end its wait in the leaders' exchange, if it waits there."""
        leaders = self._leaders
        if leaders is not None:
            leaders.interrupt()


def _tell_other_hosts(leaders: LeaderExchange, error: CollectiveError, rank: int) -> None:
    """This host failed: still take part in the leaders' exchange, carrying a negative
    marker that MIN spreads, so other hosts raise now instead of at their timeout."""
    culprit = error.ranks[0] if error.ranks else rank
    try:
        leaders.min2(-(culprit + 1), 0)
    except Exception as e:  # noqa: BLE001 - another host is gone too; our error stands
        log.debug("could not tell the other hosts of the failure: %s", e)


def _describe_guard(rank: int) -> Callable[[int], str]:
    return lambda n: describe("guard", rank, None, None) + f" (shared-memory call #{n})"


def _wait_count(store: Any, key: str, target: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while store.add(key, 0) < target:
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    return True


def _map_segment(
    store: Any, host: int, local_ranks: list[int], rank: int, timeout_s: float, leader: tuple[int, int]
) -> tuple[segment.Segment | None, str | None]:
    """Create or map this host's segment and run the probe; (segment, None) or (None, why not).

    ``leader`` is the (pid, token) the host's leader all-gathered: its segment's name."""
    index = local_ranks.index(rank)
    n = len(local_ranks)
    prefix = f"shm/{host}/"
    key = prefix + "path"
    path = segment.segment_path(*leader)
    mapped: segment.Segment | None = None
    why: str | None = None
    try:
        if index == 0:
            for leaked in segment.remove_leaked_segments():
                log.info("removed %s, a shared-memory segment left by a job whose ranks are all gone", leaked)
            mapped = segment.Segment.create(path, n, leader[1], rank)
            # compare_set: a value someone else put there first is never overwritten, and is refused.
            published = store.compare_set(key, "", path).decode(errors="replace")
            if published != path:
                raise ValueError(
                    f"the c10d store key {key!r} already held {published[:200]!r}, written "
                    "by another client of the store; not sharing a segment through it"
                )
        else:
            store.wait([key], datetime.timedelta(seconds=timeout_s))
            published = store.get(key).decode(errors="replace")
            if published != path:
                raise ValueError(
                    f"the c10d store key {key!r} names {published[:200]!r}, not {path}, the "
                    f"segment rank {local_ranks[0]} created: another client of the store wrote "
                    "it; nothing was opened or deleted"
                )
            mapped = segment.Segment.open(path, n, leader[1])
        mapped.register(index, rank)
    except Exception as e:  # noqa: BLE001 - any reason means: not here, use gloo
        why = f"{type(e).__name__}: {e}"
    finally:
        # Counted whether or not this rank mapped it, so no rank waits for one that gave up.
        store.add(prefix + "reported", 1)
    if not _wait_count(store, prefix + "reported", n, timeout_s):
        why = why or f"not every rank of this host reported on its segment within {timeout_s:.0f}s"
    if mapped is not None:
        # Every local rank has mapped it or given up: the name can go. Only a rank that
        # created or verified this very file removes it.
        mapped.unlink_name()
    if why is None and mapped is not None:
        why = mapped.probe(local_ranks)
    return (mapped, None) if why is None else (None, why)


def build_guard_channel(
    pg: Any, store: Any, members: Sequence[int] | None = None, subgroup: Callable[[list[int]], Any] | None = None
) -> GuardChannel:
    """Every rank of ``pg`` together: the guard channel the settings ask for and this job can run.

    ``members``: the global rank of each of ``pg``'s ranks (a scope's; default: ``pg`` is the
    world). ``subgroup(ranks)``: how the leaders' group is made, called by its members only
    (a scope's groups); default: ``new_group``, which every rank of the world calls.
    """
    settings = config.settings
    ranks = tuple(members) if members is not None else tuple(range(pg.size()))
    index = pg.rank()
    rank = ranks[index]
    if settings.guard_transport == "gloo":
        return GlooGuardChannel(pg, settings.guard_desync_check, rank=rank)
    reason = segment.unavailable_reason()
    keys = _all_gather_ints(pg, [host_key(), 0 if reason else 1, os.getpid(), secrets.randbits(63)])
    hosts_of: dict[int, list[int]] = {}  # host key -> its global ranks, hosts in order of their lowest rank
    for i, (key, *_) in enumerate(keys):
        hosts_of.setdefault(key, []).append(ranks[i])
    hosts_order = list(hosts_of)
    host = hosts_order.index(keys[index][0])
    local_ranks = hosts_of[keys[index][0]]
    # Every rank sees the same lists, so every rank takes the same branch and runs the same collectives.
    unable = [ranks[i] for i, (_, ok, _, _) in enumerate(keys) if not ok]
    first = keys[ranks.index(local_ranks[0])]
    leader = (first[2], first[3])  # (pid, token): the name of this host's segment
    mapped: segment.Segment | None = None
    if not unable:
        try:
            # Store calls only: bounded, since the store's own timeout bounds none of them.
            mapped, reason = bounded(
                lambda: _map_segment(store, host, local_ranks, rank, settings.timeout_s, leader),
                settings.timeout_s + 5.0,
                "while mapping the shared-memory segment",
            )
        except StoreUnresponsive as e:
            mapped, reason = None, str(e)
        results = _all_gather_ints(pg, [0 if mapped is None else 1])
        unable = [ranks[i] for i, (ok,) in enumerate(results) if not ok]
    if unable:
        if reason:
            log.info("guard collective on rank %d: shared memory unusable here: %s", rank, reason)
        if index == 0:
            log.warning(
                "guard collective falls back to gloo (COMPILER_COLLECTIVES_GUARD_TRANSPORT=auto): "
                "rank(s) %s cannot use a shared-memory segment with their host's other ranks%s",
                unable,
                f" ({reason})" if reason else "; their logs say why",
            )
        return GlooGuardChannel(pg, settings.guard_desync_check, rank=rank)
    assert mapped is not None
    hosts = len(hosts_order)
    leader_ranks = [hosts_of[key][0] for key in hosts_order]
    leaders = None
    leaders_pg: Any = None
    if hosts > 1:
        if subgroup is None:
            # Every rank takes part in creating the group; only its members get one.
            leaders_pg = dist.new_group(
                ranks=leader_ranks,
                backend="gloo",
                timeout=datetime.timedelta(seconds=settings.timeout_s),
                group_desc="compiler_collectives_guard_leaders",
            )
        elif rank in leader_ranks:
            leaders_pg = subgroup(leader_ranks)
        if rank == leader_ranks[host]:
            leaders = LeaderExchange(leaders_pg, host, hosts)
        else:
            leaders_pg = None  # not a member: torch's placeholder, not a group
    arrival = shm.Arrival(rank=rank, local_ranks=tuple(local_ranks), leader_index=0)
    exchange = shm.LocalExchange(mapped, local_ranks.index(rank), arrival, settings.timeout_s, _describe_guard(rank))
    if index == 0:
        log.info("guard collective on shared memory: %d host(s), %d rank(s) on this host", hosts, len(local_ranks))
    return ShmGuardChannel(pg, len(local_ranks), exchange, hosts, leaders, leaders_pg)
