"""Connection probes: whether this rank's gloo connection to a peer broke.

* ``broken_connection``: whether this rank's connection to one peer broke.
  When a process ends, its host's kernel closes its sockets and gloo marks
  each of its connections broken; an operation started on a broken one raises
  at once, and one pending on it fails at once. A zero-byte receive on a tag
  nobody sends on (``PROBE_TAG``) is that look, so no collective of ours ever
  meets it. This is evidence of death that needs no heartbeat: a stopped
  process, or one whose native call holds the GIL, keeps its connections
  (gloo's own threads serve them). Each receive posted leaves an entry on
  both ends that nothing ever matches, so one receive per peer and group is
  posted and kept pending (``pending_probes``), and re-posted only once it
  ended. Gloo tells nothing of a receive that nobody waits for: its work has
  no future (``get_future``: not implemented for gloo's send and receive, torch
  2.13 and 2.15), ``is_completed`` and ``exception`` stay blank after its
  connection broke, until a wait, which then raises at once; a timed wait that
  expires closes every connection of the group; and a receive from any peer
  (``recv_anysource``) is not ended by one peer's connection breaking, so no one
  wait watches several peers. So a daemon thread per pending receive waits for
  it untimed (a ten-year bound), and ends when the connection breaks
  (``tests/faults/test_connection_probes.py`` holds gloo to this). Every pending receive is ended when a generation ends
  (``end_probes``: ``GROUP_ENDING``, ``GROUP_DESTROYED``, ``RESET``) by
  expiring one timed wait on it, which closes that group's connections (it is
  going, and a receive pending on it would keep its connections open).
* ``broken_peers``: after an operation failed, which members' connections
  broke (one look each, no thread).
* ``close_connections``: that same expiry on purpose, for a wait that must
  end now on a group that is of no further use to this rank.

Every receive is started as ``gloo.started`` starts our operations: outside
torch's Python dispatcher.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .gloo import started

# The logger these probes had in gloo.py, where they started: filters on it keep working.
log = logging.getLogger("compiler_collectives.transport.gloo")

PROBE_TAG = 1 << 29
"""The tag of ``broken_connection``'s receives: no operation of ours sends on it (compile once's
pieces have bit 30 set; collectives use slots of their own)."""

_GLOO_SOURCE = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")


def gloo_words(error: BaseException) -> str:
    """The first line of gloo's error, without its source location or its advice."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return _GLOO_SOURCE.sub("", text).split(". This is typically")[0]


def connections_can_be_looked_at() -> bool:
    """Whether ``broken_connection`` can look: not in torch's lazily connected gloo groups
    (``TORCH_GLOO_LAZY_INIT``), which connect at a pair's first operation, so that a look at
    a connection never made would make it (and wait for the peer)."""
    return os.environ.get("TORCH_GLOO_LAZY_INIT", "0").lower() not in ("1", "true", "yes", "on")


_FOREVER = datetime.timedelta(days=3650)  # a probe's wait: no bound that expires (see the module docstring)
_EXPIRE = datetime.timedelta(milliseconds=1)  # a wait that expires at once (0 means no bound to gloo)


class _Probe:
    """One pending ``PROBE_TAG`` receive from one peer, and the daemon thread that waits for it."""

    __slots__ = ("pg", "thread", "why", "work")

    def __init__(self, pg: dist.ProcessGroup, work: Any) -> None:
        self.pg = weakref.ref(pg)  # never keeps the group (and its store) alive
        self.work: Any = work
        self.why: str | None = None  # what broke its connection: gloo's words
        self.thread = threading.Thread(target=self._wait, name="compiler_collectives-probe", daemon=True)
        self.thread.start()

    @property
    def pending(self) -> bool:
        return self.thread.is_alive()

    def _wait(self) -> None:
        try:
            self.work.wait(_FOREVER)  # nobody sends on its tag: returns only if someone did (intact)
        except Exception as e:  # noqa: BLE001 - gloo's RuntimeError: the connection broke
            self.why = f"gloo: {gloo_words(e)}"
        finally:
            self.work = None  # the receive holds the group's connections: let them go with it

    def end(self) -> None:
        """Expire a timed wait on the receive: gloo closes the group's connections and fails every
        operation pending on them, this receive too (its thread ends)."""
        work = self.work
        if work is None or not self.pending:
            return
        try:
            work.wait(_EXPIRE)
        except Exception as e:  # noqa: BLE001 - the expiry's own error, or the connection had broken
            log.debug("ending a connection probe: %s", gloo_words(e))


# (id(group), group rank of the peer) -> its probe; the probe checks that the group is the same.
_probes: dict[tuple[int, int], _Probe] = {}
_probes_lock = threading.Lock()
_inherited_probes: list[_Probe] = []  # a forked child's copies of its parent's: kept, never used


def broken_connection(pg: dist.ProcessGroup, peer: int) -> str | None:
    """What broke this rank's connection to group rank ``peer`` of ``pg`` (gloo's words, as
    ``gloo: ...``), or None while it is intact or cannot be looked at (see the module docstring).
    One receive per peer and group is pending at a time, however often this looks."""
    if peer == pg.rank() or not connections_can_be_looked_at():
        return None
    key = (id(pg), peer)
    with _probes_lock:
        probe = _probes.get(key)
        if probe is not None and probe.pg() is pg:
            if probe.pending:
                return None
            if probe.why is not None:
                return probe.why  # broken for good: gloo never mends a connection
        try:
            work = started(pg.recv, [torch.empty(0, dtype=torch.uint8)], peer, PROBE_TAG)
        except RuntimeError as e:
            _probes.pop(key, None)
            return f"gloo: {gloo_words(e)}"
        _probes[key] = _Probe(pg, work)
    return None


def pending_probes() -> int:
    """How many ``broken_connection`` receives are pending now (at most one per peer and group)."""
    with _probes_lock:
        return sum(probe.pending for probe in _probes.values())


def end_probes(join_s: float = 0.0) -> bool:
    """End every pending connection probe (see the module docstring); with ``join_s``, wait that
    long for their threads (interpreter exit). True if every thread ended."""
    global _probes
    with _probes_lock:
        probes, _probes = list(_probes.values()), {}
    for probe in probes:
        probe.end()
    deadline = time.monotonic() + join_s
    for probe in probes:
        if join_s > 0:
            probe.thread.join(max(0.0, deadline - time.monotonic()))
    return not any(probe.pending for probe in probes)


def after_fork_in_child() -> None:
    """A forked child: the parent's probes kept alive and never used, a fresh lock."""
    global _probes, _probes_lock
    _inherited_probes.extend(_probes.values())
    _probes, _probes_lock = {}, threading.Lock()


def close_connections(pg: dist.ProcessGroup) -> None:
    """Close every connection of this rank in ``pg`` now: every operation pending on them fails at
    once, on any thread. For a group of no further use to this rank (it failed) where a thread
    waits untimed on it. Gloo's own way: a timed wait that expires (on a probe receive)."""
    for peer in range(pg.size()):
        if peer == pg.rank():
            continue
        try:
            work = started(pg.recv, [torch.empty(0, dtype=torch.uint8)], peer, PROBE_TAG)
        except RuntimeError:
            continue  # that connection broke already: another one may not have
        try:
            work.wait(_EXPIRE)
        except RuntimeError as e:
            log.debug("closing the connections of a group: %s", gloo_words(e))
        return


def broken_peers(pg: dist.ProcessGroup, members: Sequence[int] | None = None) -> dict[int, str]:
    """Every member of ``pg`` whose connection to this rank broke: global rank (``members``
    names them; None: the group's ranks) -> gloo's words. For a failed operation: which peer's
    connection broke, where gloo's error names only an address. Looks once, after a failure:
    a receive started on each connection fails at once if it broke, and is dropped if not (no
    thread per peer here; the entry it leaves behind is one per peer per failure)."""
    named = list(members) if members is not None else list(range(pg.size()))
    found: dict[int, str] = {}
    for peer in range(pg.size()):
        if peer == pg.rank() or not connections_can_be_looked_at():
            continue
        try:
            started(pg.recv, [torch.empty(0, dtype=torch.uint8)], peer, PROBE_TAG)
        except RuntimeError as e:
            found[named[peer]] = f"gloo: {gloo_words(e)}"
    return found
