"""A tree over one gloo group's ranks by host, for exchanges whose cost must not grow with the world.

Compile once settles each graph's keys, sends each compiling rank's result and counts who loaded;
as all-gathers or a ring all-reduce on the whole group those cost O(N) hops and, for the
all-gathers, O(N) bytes per rank. Over a ``HostTree`` they cost O(log hosts) steps and O(1) bytes
per rank (a host's leader: O(ranks on its host)):

* ``min_ints``: the element-wise MIN of every rank's fixed record. Each rank sends its record to
  its host's leader (the host's lowest rank), the leader folds them, the leaders MIN-reduce by
  recursive doubling (``hierarchy.doubling_plan``, as the guard collective's leaders do:
  ceil(log2 H) rounds, two more when H is not a power of two) and each leader sends the outcome
  back to its host's ranks. Every record travels at one width (``HostTree.width``), so that two
  ranks in different exchanges still pair up, and see it in the records (callers put the
  exchange's phase and number in them): they never wait for one another.
* ``broadcast``: one rank's bytes down a binomial tree over the group (ceil(log2 N) rounds; a
  header of the length and a stamp the receivers compare, then the bytes).

Point-to-point operations on the group itself, on tags of their own (``TAG_BASE``): no group
more per host, and a rank of another host is one gloo connection away, as it is for compile
once's artifact tree. Within a host the records go over gloo's loopback connections, not the
guard's shared-memory segment: a few tens of microseconds per graph, which compile once (one
exchange per compiled graph, not per call) can afford.

Gloo's send and receive cannot be waited for in slices (a timed wait that expires closes every
connection of the group), and a rank waits here for peers still compiling or running user code:
each exchange runs on a helper thread that waits with the group's own timeout, and the calling
thread waits for it in ``gloo.wait``'s slices, stopping once a peer is known to have failed.

Built once per generation of our groups, every rank together, from one all-gather of each
rank's host key (``hierarchy.host_key``: torchrun's agents are hosts). The tree holds ints
only: the caller passes the group to each exchange, so nothing here keeps a group (and its
store) alive past its generation.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist

from ..errors import WireFormatError
from .gloo import started, tensor_view, wait
from .hierarchy import doubling_plan, host_key

# Tags of these operations: bit 28 (compile once's pieces have bit 30; gloo.PROBE_TAG is bit 29).
TAG_BASE = 1 << 28
_UP, _DOWN, _HEAD, _BYTES = TAG_BASE | 1, TAG_BASE | 2, TAG_BASE | 3, TAG_BASE | 4
_LEADERS = TAG_BASE | 0x100  # plus the doubling plan's tag
NEUTRAL = (1 << 63) - 1
"""A record element nobody set: MIN's identity."""


@dataclasses.dataclass(frozen=True)
class HostTree:
    """Group ranks by host (hosts in order of their lowest rank), this rank's place, the record width."""

    index: int  # this rank in the group
    hosts: tuple[tuple[int, ...], ...]  # group ranks of each host, ascending
    place: tuple[tuple[int, int], ...]  # group rank -> (host, index on its host)
    width: int  # int64s per record of ``min_ints``
    NEUTRAL: ClassVar[int] = NEUTRAL

    @classmethod
    def build(
        cls, pg: dist.ProcessGroup, width: Callable[[int], int], describe: Callable[[], str] | None = None
    ) -> HostTree:
        """Every rank of ``pg`` together: one all-gather of host keys. ``width(ranks_per_host)``:
        the record width (the same on every rank)."""
        mine = torch.tensor([host_key()], dtype=torch.int64)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(pg.size())]
        wait(started(pg.allgather, [out], [mine]), describe)
        by_key: dict[int, list[int]] = {}
        for i, t in enumerate(out):
            by_key.setdefault(int(t[0]), []).append(i)
        hosts = tuple(tuple(v) for v in by_key.values())
        place = [(0, 0)] * pg.size()
        for h, ranks in enumerate(hosts):
            for j, i in enumerate(ranks):
                place[i] = (h, j)
        return cls(pg.rank(), hosts, tuple(place), width(max(len(h) for h in hosts)))

    @property
    def size(self) -> int:
        return len(self.place)

    @property
    def host(self) -> int:
        return self.place[self.index][0]

    @property
    def local_index(self) -> int:
        return self.place[self.index][1]

    @property
    def ranks_per_host(self) -> int:
        return max(len(h) for h in self.hosts)

    def min_ints(self, pg: dist.ProcessGroup, values: list[int], describe: Callable[[], str]) -> list[int]:
        """The element-wise MIN of every rank's ``values`` (at most ``width``; every rank the same length)."""
        return _sliced(lambda: self._min_ints(pg, values), describe)

    def _min_ints(self, pg: dist.ProcessGroup, values: list[int]) -> list[int]:
        n = len(values)
        buf = torch.full((self.width,), NEUTRAL, dtype=torch.int64)
        buf[:n] = torch.tensor(values, dtype=torch.int64)
        local = self.hosts[self.host]
        leader = local[0]
        if self.index != leader:
            _done(started(pg.send, [buf], leader, _UP))
            _done(started(pg.recv, [buf], leader, _DOWN))
            return [int(v) for v in buf[:n].tolist()]
        got = [torch.empty(self.width, dtype=torch.int64) for _ in local[1:]]
        works = [started(pg.recv, [g], peer, _UP) for g, peer in zip(got, local[1:])]
        for work, g in zip(works, got):
            _done(work)
            torch.minimum(buf, g, out=buf)
        if len(self.hosts) > 1:
            self._leaders(pg, buf)
        sends = [started(pg.send, [buf], peer, _DOWN) for peer in local[1:]]
        for work in sends:
            _done(work)
        return [int(v) for v in buf[:n].tolist()]

    def _leaders(self, pg: dist.ProcessGroup, buf: torch.Tensor) -> None:
        other = torch.empty_like(buf)
        leaders = [h[0] for h in self.hosts]
        for op, peer, tag in doubling_plan(self.host, len(self.hosts)):
            dst, tag = leaders[peer], _LEADERS + tag
            sent = None
            if op in ("give", "tell", "swap"):
                sent = started(pg.send, [buf], dst, tag)
                if op != "swap":
                    _done(sent)
                    continue
            _done(started(pg.recv, [other], dst, tag))
            if sent is not None:
                _done(sent)
            if op == "take":
                buf.copy_(other)
            else:
                torch.minimum(buf, other, out=buf)

    def broadcast(
        self,
        pg: dist.ProcessGroup,
        root: int,
        payload: bytes | None,
        stamp: int,
        max_bytes: int,
        describe: Callable[[], str],
        name: Callable[[int], int] = lambda i: i,
    ) -> tuple[int, bytes]:
        """Group rank ``root``'s ``payload`` on every rank, with the ``stamp`` it sent (the
        caller compares it with its own). ``max_bytes``: a larger announced length raises
        ``WireFormatError`` naming ``root`` (``name``: group rank -> global), allocating nothing."""
        return _sliced(lambda: self._broadcast(pg, root, payload, stamp, max_bytes, describe, name), describe)

    def _broadcast(
        self,
        pg: dist.ProcessGroup,
        root: int,
        payload: bytes | None,
        stamp: int,
        max_bytes: int,
        describe: Callable[[], str],
        name: Callable[[int], int],
    ) -> tuple[int, bytes]:
        size = self.size
        v = (self.index - root) % size
        head = torch.zeros(2, dtype=torch.int64)
        if v == 0:
            assert payload is not None
            data = (
                torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                if payload
                else torch.empty(0, dtype=torch.uint8)
            )
            head[0], head[1] = len(payload), stamp
        else:
            parent = (root + v - (1 << (v.bit_length() - 1))) % size
            _done(started(pg.recv, [head], parent, _HEAD))
            length = int(head[0])
            if length > max_bytes:
                raise WireFormatError(
                    f"{describe()}: rank {name(root)} announced a {length}-byte payload, over the limit of "
                    f"{max_bytes} bytes (COMPILER_COLLECTIVES_MAX_PAYLOAD_BYTES); raise the limit on every rank "
                    "if it is legitimately that large",
                    ranks=(name(root),),
                )
            data = torch.empty(length, dtype=torch.uint8)
            if length:
                _done(started(pg.recv, [data], parent, _BYTES))
        children = []
        k = v.bit_length()
        while v + (1 << k) < size:
            children.append((root + v + (1 << k)) % size)
            k += 1
        works = []
        for child in children:
            works.append(started(pg.send, [head], child, _HEAD))
            if data.numel():
                works.append(started(pg.send, [data], child, _BYTES))
        for work in works:
            _done(work)
        if v == 0:
            assert payload is not None
            return stamp, payload
        return int(head[1]), bytes(tensor_view(data))


T = TypeVar("T")


def _done(work: Any) -> None:
    """Wait for a point-to-point operation with gloo's own timeout (the group's): a timed wait
    on one (``gloo.wait``'s slices) would close every connection of the group when it expires."""
    work.wait()


class _Background:
    """An exchange run on a helper thread, waited for as a gloo work (``gloo.wait``: in slices,
    stopping once a peer is known to have failed). Gloo's send and receive cannot be waited for in
    slices, and a rank waits in these exchanges for peers still compiling or running user code."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self._done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        threading.Thread(target=self._run, name="compiler_collectives-hosttree", daemon=True).start()

    def _run(self) -> None:
        try:
            self.value = self._fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            self.error = e
        finally:
            self._done.set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("the exchange has not ended yet")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()


def run_p2p(fn: Callable[[], T], describe: Callable[[], str] | None = None) -> T:
    """``fn()`` (gloo sends and receives, waited for with ``work.wait()``: the group's timeout) on a
    helper thread, waited for here as ``gloo.wait`` waits for a collective: in slices, stopping once
    a peer is known to have failed. A timed wait of gloo's on a send or receive would close every
    connection of the group when it expires."""
    return _sliced(fn, describe)


def _sliced(fn: Callable[[], T], describe: Callable[[], str] | None) -> T:
    job = _Background(fn)
    wait(job, describe)
    value: T = job.value
    return value
