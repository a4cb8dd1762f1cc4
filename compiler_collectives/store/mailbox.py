"""Notices on the store: a rank leaves a value under a name, its peers read it or wait for it.

A side channel's ``Mailbox`` keeps notices under ``post/<name>`` of the
generation's store prefix. ``post`` and ``read_post`` are bounded like every
store call of ours (on the side channel's ``StoreCaller``). A wait for
notices (``NoticeWait``) blocks in the store's own ``wait`` on a connection of
its own (one per generation, made with the generation's compile group where
compile once is on, kept between waits and dropped with the side channel at
``GROUP_ENDING``), so that it asks the store two requests per wait (a ``wait``
for all its notices, a ``multi_get`` of them), not one per poll, and holds up
no other store call. A wait that stops leaves ``GAVE_UP`` under the notices it
waited for, which ends the store's wait on every rank.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Sequence
from typing import Any

from .. import config
from ..errors import StoreFailureError
from .calls import StoreCaller, count_requests, store_error_text, store_name

# The name logs were filtered by before the store had a layer of its own.
log = logging.getLogger("compiler_collectives.watchdog")

GAVE_UP = b"\x00gave up: "
"""What a ``NoticeWait`` leaves under a notice it stops waiting for (it is cancelled): its wait
on the store returns only once the key exists. Never a notice's value (notices are text);
``read_post`` reads it as nothing posted, and the poster's own post replaces it."""

GAVE_UP_POLL_S = 0.2  # how often a wait that found another rank's GAVE_UP looks for the real post


class NoticeWait:
    """Notices awaited with the store's own blocking ``wait``, on one daemon thread and a store
    connection of its own (``Store.clone``; the mailbox keeps one between waits, so a process
    connects once per generation, not once per wait: ``Mailbox.notice_connection``): one
    ``wait`` for all the notices and one ``multi_get`` of them, however many and however long
    they take, and the wait never holds up the heartbeat's or any other store call (a TCPStore
    client runs one call at a time). The waiting thread asks ``done`` (no store request) and
    ``cancel``s when it stops waiting: that leaves ``GAVE_UP`` under every notice not posted,
    which ends the store's wait, so this thread never outlives its waiter by more than a store
    call. Every other rank waiting for those notices then looks for the real posts every
    ``GAVE_UP_POLL_S`` (it is hearing of the failure that made this rank give up). A store that
    cannot be cloned (a Python ``Store``) is polled at that pace instead.

    A store that fails under the wait (its host gone: the connection closed; a call that
    raised) ends it at once: ``done``, and ``result`` raises ``StoreFailureError`` naming the
    store and the notice. One that stops answering blocks this thread like a notice not yet
    posted: the waiter's bounded reads of its peers' records find it out (health's
    ``watch_peer``)."""

    CANCEL_JOIN_S = 1.0

    def __init__(self, mailbox: Mailbox, keys: Sequence[str], timeout_s: float) -> None:
        self._mailbox = mailbox
        self.store = mailbox.store_name
        """How messages name the store (``store_name``)."""
        self._keys = list(keys)
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._values: list[bytes | None] = [None] * len(self._keys)
        self._stop = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="compiler_collectives-notices", daemon=True)
        self._thread.start()

    def done(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every notice (or the store's error): True once there."""
        return self._done.wait(timeout_s)

    def posted(self) -> list[bytes | None]:
        """Each key's notice, None where none arrived yet (the store's ``wait`` returns once all
        did: until then, none reads as arrived; ``result`` raises the store's error)."""
        return list(self._values)

    def result(self) -> list[bytes]:
        """Every notice, once ``done``; ``StoreFailureError`` (the store's error its cause) if
        the store failed under the wait."""
        error = self._error
        if error is not None:
            waited = ", ".join(repr(k) for k, v in zip(self._keys, self._values) if v is None)
            raise StoreFailureError(
                f"rank {self._mailbox.rank}: {self.store} failed while this rank waited on it for the "
                f"notice{'s' if ', ' in waited else ''} {waited} ({store_error_text(error)})",
                rank=self._mailbox.rank,
            ) from error
        values = [v for v in self._values if v is not None]
        assert len(values) == len(self._keys), "result() before done()"
        return values

    def cancel(self, why: str) -> None:
        """Stop waiting (``why`` is left with ``GAVE_UP`` for the other ranks' logs)."""
        if self._done.is_set():
            return
        self._stop.set()
        try:
            for key, value in zip(self._keys, self._values):
                if value is None:  # the store's wait returns once every key is there
                    self._mailbox.give_up_on(key, why)
        except Exception as e:  # noqa: BLE001 - a store that does not answer ends the wait with an error
            log.debug("ending a wait for a notice: %s", e)
        self._thread.join(self.CANCEL_JOIN_S)

    def abandon(self) -> None:
        """Stop waiting without a word to the store (it failed, or stopped answering: asking it
        to end the wait would cost one more bounded call). This thread ends once its store call
        returns."""
        self._stop.set()

    def _run(self) -> None:
        own = None
        try:
            own = self._mailbox.notice_connection()
            if own is not None and not self._stop.is_set():
                count_requests()
                own.wait(self._keys, self._timeout)
                if not self._stop.is_set():  # a cancel's GAVE_UP woke it: nothing to read
                    count_requests()
                    for i, value in enumerate(own.multi_get(self._keys)):
                        if not value.startswith(GAVE_UP):
                            self._values[i] = value
            self._poll(own if own is not None else self._mailbox.store)
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            self._error = e
        finally:
            if own is not None and self._error is None:
                self._mailbox.spare_connection(own)  # its calls all returned: the next wait takes it
            self._done.set()

    def _poll(self, store: Any) -> None:
        """Look for each notice not read yet (another rank's ``GAVE_UP`` under it, or a store that
        cannot be cloned) every ``GAVE_UP_POLL_S`` until all arrived or the wait stops."""
        for i, key in enumerate(self._keys):
            while self._values[i] is None and not self._stop.wait(GAVE_UP_POLL_S):
                count_requests()
                if store.check([key]):
                    count_requests()
                    value = store.get(key)
                    if not value.startswith(GAVE_UP):
                        self._values[i] = value


class Mailbox:
    """The notices of one side channel, under ``post/`` of its store (a generation's prefix);
    its bounded calls run on the side channel's ``StoreCaller``."""

    def __init__(self, store: Any, rank: int, caller: StoreCaller) -> None:
        self.store = store
        self.rank = rank
        self.store_name = store_name(store)
        """How messages name the store ("the c10d store at host:port")."""
        self._caller = caller
        # A NoticeWait's store connection, kept between waits (``notice_connection``).
        self._spare: Any = None
        self._spare_lock = threading.Lock()
        self._closed = False

    def post(self, name: str, value: bytes) -> None:
        """Leave ``value`` under ``name`` for the peers (bounded like every store call of ours)."""

        def post() -> None:
            count_requests()
            self.store.set(f"post/{name}", value)  # c10d takes bytes (its stubs say str)

        self._caller.call(post, config.settings.timeout_s, "posting a notice")

    def read_post(self, name: str) -> bytes | None:
        """The value posted under ``name``, or None if nothing is posted yet (never waits)."""

        def read() -> bytes | None:
            key = f"post/{name}"
            count_requests()
            if not self.store.check([key]):
                return None
            count_requests()
            value: bytes = self.store.get(key)
            return None if value.startswith(GAVE_UP) else value

        return self._caller.call(read, config.settings.timeout_s, "reading a notice")

    def wait_posts(self, names: Sequence[str], timeout_s: float) -> NoticeWait:
        """Start waiting for a notice under each of ``names`` (``NoticeWait``): on a store
        connection of its own, so that the heartbeat's and every other store call go on meanwhile."""
        return NoticeWait(self, [f"post/{name}" for name in names], timeout_s)

    def connect(self) -> None:
        """Make the connection the next ``NoticeWait`` takes, now (bounded by the caller): a
        generation's cost, paid where its groups are made, not in its first wait."""
        connection = self.notice_connection()
        if connection is not None:
            self.spare_connection(connection)

    def notice_connection(self) -> Any:
        """A store connection for one ``NoticeWait`` alone: the spare one a wait before it left
        (``spare_connection``), else a new one (``Store.clone``: it connects); None where the
        store cannot be cloned (a Python ``Store``: notices are polled)."""
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            return spare
        count_requests()  # a TCPStore's clone connects
        try:
            store: Any = self.store  # PrefixStore: its stubs lack clone
            return store.clone()
        except Exception as e:  # noqa: BLE001 - a store type without clone: polled instead
            log.debug("the store cannot be cloned (%s): notices are polled", e)
            return None

    def spare_connection(self, connection: Any) -> None:
        """A ``NoticeWait`` is done with ``connection`` (every call of its returned, none failed):
        kept for the next one, one at most, none once this mailbox closed."""
        with self._spare_lock:
            if self._spare is None and not self._closed:
                self._spare = connection

    def close(self) -> None:
        """Drop the spare connection, and keep none from now on (its side channel stopped: the
        store's last reference goes with the channel's, at ``GROUP_ENDING``)."""
        with self._spare_lock:
            self._closed = True
            self._spare = None

    def give_up_on(self, key: str, why: str) -> None:
        """Leave ``GAVE_UP`` under ``key`` unless something is posted there (bounded): with one
        under each key it waits for, a store wait ends, on any rank."""

        def leave() -> None:
            count_requests()
            self.store.compare_set(key, b"", GAVE_UP + why.encode()[:200])

        self._caller.call(leave, min(config.settings.timeout_s, 5.0), "ending a wait for a notice")
