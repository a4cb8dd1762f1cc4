"""Where each moment that clears the process's state is run: ``process_state`` holds the list.

Every module declares what it holds in ``compiler_collectives/process_state.py``
(``process_state.describe()`` lists it); here each moment runs that list:

* ``reset()``: the user's ``compiler_collectives.reset()`` on every rank: clear
  a failure, forget our groups, start every sequence again (a new generation).
* ``torch_reset()``: ``torch.compiler.reset()`` (the Dynamo seam calls it):
  Dynamo's caches went, entry agreement's registry of them goes too.
* ``default_group_ending()``: ``destroy_process_group()`` of the default group
  is about to run (the c10d seam calls it first): every reference of ours to
  its store goes, and our threads are told to stop, nothing waited for, so
  that torch's own teardown closes the store's server.
* ``default_group_destroyed()``: ``destroy_process_group()`` of the default
  group returned (the c10d seam calls it then). The same as ``reset()``,
  without destroying anything (torch has shut our groups down with the
  default group), so that a later ``init_process_group``, on the same port
  too, starts a new generation from nothing.
* ``after_fork_in_child()``: a forked child (a DataLoader worker) gets a fresh
  state of its own; what it inherited from its parent is kept alive but
  never used (``transport.groups``).
* ``reset_stats()``: ``compiler_collectives.reset_stats()``.

This module imports every agreement that declares state, so that each has
declared it before any moment runs.
"""

from __future__ import annotations

from .. import health, ledger, process_state
from ..transport import groups
from . import audit, compiler, entry, guard, once

# Imported for their declarations (see the docstring), not called here.
DECLARING = (health, ledger, groups, audit, compiler, entry, guard, once)


def reset() -> None:
    process_state.run(process_state.RESET)


def torch_reset() -> None:
    process_state.run(process_state.TORCH_RESET)


def default_group_ending() -> None:
    process_state.run(process_state.GROUP_ENDING)


def default_group_destroyed() -> None:
    process_state.run(process_state.GROUP_DESTROYED)


def after_fork_in_child() -> None:
    process_state.run(process_state.FORK)


def reset_stats() -> None:
    process_state.run(process_state.STATS)
