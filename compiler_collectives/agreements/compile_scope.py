"""One scope per Dynamo compile, and the one way our error leaves our code through torch.

Torch wraps whatever our code raises inside a compile: Dynamo rewraps a trace's
error as ``InternalTorchDynamoError`` (``from None``), a backend's as
``BackendCompilerFailed``, and AOTAutograd's cache lookup takes any exception
for a cache bypass. The user must still get our error, as itself. So:

* The Dynamo seam opens a ``CompileScope`` around each frame compile
  (``opened``); it is found through one context variable, as torch's own
  ``TracingContext`` is. A nested compile gets its own and the outer one is
  current again after it.
* Every seam torch calls leaves our code through ``boundary`` (a decorator):
  our error (a ``CollectiveError``) is latched in the current scope and
  re-raised, into torch.
* Whoever receives torch's wrapper raises the latched error in its place
  (``CompileScope.raise_latched``): the compile entry wrapper, whatever torch
  wrapped it in, and compile once's lookup seam, where AOTAutograd took ours
  for a bypass. Nothing is dug out of torch's exception.

The scope also holds what the seams keep for the compile in progress (the
frame and its locals, the exchange boxes it opened, the frame the backend
compiles, compile once's current graph): per compile, not
per thread.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..errors import CollectiveError

F = TypeVar("F", bound=Callable[..., Any])


class CompileScope:
    """One Dynamo frame compile in progress: our error on its way out, and the seams' state."""

    __slots__ = ("boxes", "error", "frame", "once_graph", "pending", "post_grad_depth", "user_lowering")

    def __init__(self, pending: Any = None) -> None:
        # Our error latched as it left our code into torch (the latest: the one torch wrapped).
        self.error: CollectiveError | None = None
        # (code, frame locals) of the frame being compiled, for the input exchange.
        self.pending: Any = pending
        # The exchanges' boxes (DistributedState) this compile opened: ended with it.
        self.boxes: list[Any] = []
        # The frame whose graph the backend compiles now (for compile once's messages).
        self.frame: Any = None
        # Compile once: the backward lowering the user set (None: not inside an AOTAutograd
        # compile of ours).
        self.user_lowering: bool | None = None
        # Inductor's post-grad passes recurse into subgraphs through our wrapper.
        self.post_grad_depth = 0
        # Compile once: the driver of the AOTAutograd (or FX) compile in progress (``once.current``).
        self.once_graph: Any = None

    def latch(self, error: CollectiveError) -> None:
        """Our error leaves our code into torch: kept for the one who receives torch's wrapper."""
        self.error = error

    def raise_latched(self, raised: BaseException | None = None) -> None:
        """Raise our error latched in this scope in place of ``raised`` (torch's wrapper of it, or
        nothing where torch swallowed it); returns if none is latched, or ``raised`` is it.

        Only an ``Exception`` is replaced: a ``KeyboardInterrupt`` stays itself."""
        error = self.error
        if error is None or error is raised or (raised is not None and not isinstance(raised, Exception)):
            return
        raise error from error.__cause__


_current: contextvars.ContextVar[CompileScope | None] = contextvars.ContextVar(
    "compiler_collectives_compile_scope", default=None
)


def current() -> CompileScope | None:
    """The scope of the Dynamo compile in progress here, None outside one."""
    return _current.get()


@contextlib.contextmanager
def opened(pending: Any = None) -> Iterator[CompileScope]:
    """A new scope for one Dynamo compile, current until it ends. Our error that leaves it goes
    on into the enclosing compile's scope, if any (it leaves our code into that compile's torch)."""
    scope = CompileScope(pending)
    token = _current.set(scope)
    try:
        yield scope
    except CollectiveError as e:
        _current.reset(token)
        leave(e)
        raise
    except BaseException:
        _current.reset(token)
        raise
    else:
        _current.reset(token)


def leave(error: CollectiveError) -> None:
    """Latch ``error`` in the current scope (outside a compile there is nobody to raise it)."""
    scope = _current.get()
    if scope is not None:
        scope.latch(error)


def boundary(seam: F) -> F:
    """A seam torch calls: our error that leaves it is latched in the current scope, then re-raised."""

    @functools.wraps(seam)
    def leaving(*args: Any, **kwargs: Any) -> Any:
        try:
            return seam(*args, **kwargs)
        except CollectiveError as e:
            leave(e)
            raise

    leaving.__compiler_collectives_boundary__ = True  # type: ignore[attr-defined]  # the rule test's mark
    return leaving  # type: ignore[return-value]
