"""Point-to-point exchanges on a gloo group, waited for as a collective is.

Gloo's send and receive cannot be waited for in slices (a timed wait that expires closes every
connection of the group), and a rank may wait in these exchanges for peers still busy with
other work: ``run_p2p`` runs an exchange of sends and receives (each waited for with the group's
own timeout) on a helper thread, and the calling thread waits for it in ``gloo.wait``'s slices,
stopping once a peer is known to have failed. After a failure the helper thread waits for the
operations that may not have ended (gloo keeps writing into, and reading from, their buffers).

``gather_ints``: every rank's int on every rank, by Bruck's all-gather over point-to-point
operations (ceil(log2 N) rounds for any N; gloo's own all-gather is a ring of N - 1 hops). The
host tree (``hosttree``) is built from one.

Tags: every point-to-point operation of this layer has bit 28 set (``TAG_BASE``); the connection
probes' ``probes.PROBE_TAG`` is bit 29, and callers keep their own operations off both.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .gloo import started, wait

TAG_BASE = 1 << 28
"""Bit 28: the tags of this layer's point-to-point operations (``hosttree``'s records, ``gather_ints``)."""

_GATHER_INTS = TAG_BASE | 0x40  # plus the round: at most 63 rounds (N < 2**63)


def gather_ints(pg: dist.ProcessGroup, value: int) -> list[int]:
    """Every rank's ``value``, by group rank, on every rank: Bruck's all-gather over point-to-point
    operations, ceil(log2 N) rounds for any N (gloo's own all-gather is a ring: N - 1 hops, 205 ms
    at 8,192 ranks in the scale model). Round k doubles what each rank holds: it sends the first
    2**k values it has (its own and those of the ranks after it) to the rank 2**k before it, and
    receives as many from the rank 2**k after it. Call it off the calling thread (``run_p2p``)."""
    size, me = pg.size(), pg.rank()
    have = torch.empty(size, dtype=torch.int64)  # have[j]: the value of group rank (me + j) % size
    have[0] = value
    held, k = 1, 0
    while held < size:
        n = min(held, size - held)
        out = have[:n].clone()
        into = torch.empty(n, dtype=torch.int64)
        sent = started(pg.send, [out], (me - held) % size, _GATHER_INTS + k)
        done(started(pg.recv, [into], (me + held) % size, _GATHER_INTS + k))
        done(sent)
        have[held : held + n] = into
        held, k = held + n, k + 1
    values = have.tolist()
    return [values[(i - me) % size] for i in range(size)]


T = TypeVar("T")


def done(work: Any) -> None:
    """Wait for a point-to-point operation with gloo's own timeout (the group's): a timed wait
    on one (``gloo.wait``'s slices) would close every connection of the group when it expires."""
    work.wait()


class Background:
    """An exchange run on a helper thread, waited for as a gloo work (``gloo.wait``: in slices,
    stopping once a peer is known to have failed). Gloo's send and receive cannot be waited for in
    slices, and a rank waits in these exchanges for peers still compiling or running user code.

    After a failure the thread waits (the group's timeout) for the gloo operations in ``linger``
    that may not have ended: gloo keeps writing into, and reading from, their buffers."""

    def __init__(self, fn: Callable[[], Any], linger: Sequence[Any] = ()) -> None:
        self._fn = fn
        self._linger = linger
        self.finished = self._done = threading.Event()
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
        if self.error is not None:
            for work in self._linger:
                try:
                    work.wait()
                except Exception:  # noqa: BLE001 - the exchange failed already; this only keeps buffers alive
                    pass

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
    return sliced(fn, describe)


def sliced(fn: Callable[[], T], describe: Callable[[], str] | None, linger: Sequence[Any] = ()) -> T:
    job = Background(fn, linger)
    wait(job, describe)
    value: T = job.value
    return value
