"""The three moments every agreement's state is dropped together.

* ``reset()``: the user's ``compiler_collectives.reset()`` on every rank: clear
  a failure, forget our groups, start every sequence again.
* ``default_group_destroyed()``: ``destroy_process_group()`` of the default
  group (the c10d seam calls it). The same, without destroying anything
  (torch has shut our groups down with the default group), so that a later
  ``init_process_group``, on the same port too, starts a new generation from
  nothing.
* ``after_fork_in_child()``: a forked child (a DataLoader worker) gets a fresh
  state of its own; what it inherited from its parent is kept alive but
  never used (``transport.groups``).
"""

from __future__ import annotations

import gc

from .. import health
from ..transport import groups
from . import audit, compiler, guard, once


def _restart_sequences() -> None:
    compiler.reset_sequence()
    guard.reset_sequence()
    audit.reset_sequence()
    once.reset_sequence()


def reset() -> None:
    health.clear()
    groups.forget()
    _restart_sequences()


def default_group_destroyed() -> None:
    groups.default_group_destroyed()
    health.clear()
    _restart_sequences()
    # A guard channel sits in a reference cycle (its bound methods): collect it now, so
    # that the old store's server closes its port before a new init_process_group binds it.
    gc.collect()


def after_fork_in_child() -> None:
    groups.after_fork_in_child()
    health.clear()
    compiler.reset_sequence()
    guard.after_fork_in_child()
    audit.reset_sequence()
    once.reset_sequence()
