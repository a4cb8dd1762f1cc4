"""Bounded calls to the c10d store, counted, and how messages name the store.

The c10d store bounds none of its calls: a stopped store host blocks a ``set``
for as long as the process group's own timeout (30 minutes by default). Ours
are bounded by ``COMPILER_COLLECTIVES_TIMEOUT`` or less. One-off calls go
through ``bounded`` (a thread each); the frequent ones (a loader reads its
peers' records for as long as a compile takes) through a ``StoreCaller``, one
long-lived thread. ``count_requests`` counts every request the store layer
sends (``stats()["store_requests"]``).

``default_store`` reaches the default group's c10d store through the source
install wires (``torch_view``): torch offers no public accessor,
so the Dynamo seam supplies it, checked by the seam table.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .. import torch_view
from ..errors import StoreUnresponsive
from ..ledger import ledger


def count_requests(n: int = 1) -> None:
    """Count ``n`` requests to the c10d store (``stats()["store_requests"]``); from any thread."""
    ledger.store_requests(n)


T = TypeVar("T")


def store_name(store: Any) -> str:
    """How messages name ``store``: "the c10d store at host:port" for a TCPStore (under any
    PrefixStores), else by its type. Reads attributes only: no store request."""
    inner = store
    for _ in range(8):
        under = getattr(inner, "underlying_store", None)  # a PrefixStore's
        if under is None:
            break
        inner = under
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    if isinstance(host, str) and isinstance(port, int):
        return f"the c10d store at {host}:{port}"
    return f"the c10d store ({type(inner).__name__})"


def store_error_text(error: BaseException) -> str:
    """A store error in one line: its type and the first line of its words (c10d's may go on
    with a C++ trace)."""
    words = str(error).strip().splitlines()
    return f"{type(error).__name__}: {words[0] if words else '(no message)'}"


def bounded(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run ``fn`` (store calls) on a helper thread; its result, its exception, or
    ``StoreUnresponsive`` after ``timeout_s``. The caller's thread never blocks longer."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, name="compiler_collectives-store", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise StoreUnresponsive(what, timeout_s)
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


class _Request:
    """One call handed to a ``StoreCaller`` worker, and what came of it."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self.error = e
        finally:
            self.done.set()


class _Worker:
    """A daemon thread running requests from its queue until it takes None."""

    def __init__(self, name: str) -> None:
        self.requests: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            request = self.requests.get()
            if request is None:
                return
            request.run()


class StoreCaller:
    """Bounded store calls on one long-lived daemon thread, for the calls made often.

    ``bounded`` starts a thread per call; a loader polling every 200 ms for an
    hour-long compile would start tens of thousands. Here each call waits for
    the one worker at most ``timeout_s`` (calls from several threads take
    turns, the turn counted in the bound). A call that overruns leaves its
    worker inside the store: that worker is retired (it ends once the store
    returns) and the next call gets a fresh one, so one slow answer never holds
    up later calls. While ``MAX_STUCK`` retired workers are still inside the
    store, it hangs: calls raise ``StoreUnresponsive`` at once instead of
    piling more threads onto it.
    """

    MAX_STUCK = 2

    def __init__(self, name: str = "compiler_collectives-store") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._worker: _Worker | None = None
        self._stuck: list[_Worker] = []

    def call(self, fn: Callable[[], T], timeout_s: float, what: str) -> T:
        """``fn``'s result or exception, or ``StoreUnresponsive`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        if not self._lock.acquire(timeout=max(0.0, timeout_s)):
            raise StoreUnresponsive(what, timeout_s)
        try:
            worker = self._ready(what, timeout_s)
            request = _Request(fn)
            worker.requests.put(request)
            if not request.done.wait(max(0.0, deadline - time.monotonic())):
                worker.requests.put(None)  # retired: it ends once the store returns
                self._stuck.append(worker)
                self._worker = None
                raise StoreUnresponsive(what, timeout_s)
        finally:
            self._lock.release()
        if request.error is not None:
            raise request.error
        value: T = request.value
        return value

    def _ready(self, what: str, timeout_s: float) -> _Worker:
        self._stuck = [w for w in self._stuck if w.thread.is_alive()]
        if len(self._stuck) >= self.MAX_STUCK:
            raise StoreUnresponsive(f"{what} (it has not returned from {len(self._stuck)} earlier calls)", timeout_s)
        worker = self._worker
        if worker is None or not worker.thread.is_alive():  # none yet, or lost (a fork keeps no threads)
            worker = self._worker = _Worker(self._name)
        return worker

    def close(self, join_s: float = 0.0) -> bool:
        """End the worker (once its call, if any, returns); with ``join_s``, wait that long. True if it ended."""
        thread = self.end()
        if thread is None:
            return True
        if join_s > 0 and thread is not threading.current_thread():
            thread.join(join_s)
        return not thread.is_alive()

    def end(self) -> threading.Thread | None:
        """Tell the worker to end (once its call, if any, returns) without waiting: its thread, or None."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is None:
            return None
        worker.requests.put(None)
        return worker.thread


def default_store() -> Any:
    """The default process group's c10d store (torch offers no public accessor: the Dynamo seam
    supplies one at install, checked by the seam table, in ``torch_view``)."""
    source = torch_view.view.default_store
    if source is None:
        raise RuntimeError("compiler_collectives is not installed: no way to reach the c10d store")
    return source()
