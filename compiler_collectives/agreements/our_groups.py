"""Our groups, as the agreements take them: making one is the first thing that can fail.

Transport builds our groups (``transport.groups``): the setup check before a
generation's first group, our rendezvous before each later one, gloo's
connection set-up. It raises what stopped a build, and decides nothing. Here
that error goes through the failure procedure (``failure.fail``, ``SETUP``):
this rank is poisoned, so its later collectives refuse until
``compiler_collectives.reset()``; nothing is counted or published.

Every agreement takes the compile group and the guard channel from here, and
so do ``compiler_collectives.scope()`` and ``doctor`` (``tests/unit/test_error_exit.py``
flags a build that bypasses it). A refusal of ``scope()`` after a compile is
no failure: it poisons nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import CollectiveError
from ..transport import GuardChannel, Scope, groups
from . import failure

T = TypeVar("T")


def _made(build: Callable[[], T]) -> T:
    """``build()``; its failure (our error) through the failure procedure, raised as it is."""
    try:
        return build()
    except CollectiveError as e:
        failure.fail(e, kind=e.kind or "setup", cause=failure.SETUP)
        raise


def compile_pg() -> Any:
    """The compile group of this generation, made on every rank together at first use."""
    return _made(groups.compile_pg)


def guard_channel() -> GuardChannel:
    """The guard channel of this generation, built on every rank together at first use."""
    return _made(groups.guard_channel)


def guard_pg() -> Any:
    """The guard channel's group (built with the channel)."""
    return guard_channel().pg


def use_scope(chosen: Scope | None) -> None:
    """``compiler_collectives.scope(chosen)``: refused after a compile (``ScopeError``, no
    failure); otherwise the choice, and for a scope its setup check, now."""
    if groups.choose_scope(chosen):
        _made(groups.agree_scope)
