"""What the layers below the Dynamo seam may see of torch: one frozen object, handed over at install.

Only ``dynamo/`` touches torch's internals (checked by its seam table). What the
store floor, transport and the agreements need of them is gathered here, in one
``TorchView`` that the Dynamo wiring builds from the seam table's originals and
hands over (``adopt``) at install; every user reads ``torch_view.view`` anew, so
nobody keeps a copy. Until install, the defaults hold: no store, nothing is an
operator, no compile in progress, the profiler off.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


def _nothing() -> None:
    return None


def _false(*_: Any) -> bool:
    return False


def _group_name(name: Any) -> str:
    return f"group {name!r}"


@dataclasses.dataclass(frozen=True)
class TorchView:
    # store.calls: the default group's c10d store (torch offers no public accessor).
    default_store: Callable[[], Any] | None = None
    # transport.gloo: what each operation of ours off the guard path starts in (torch's
    # ``no_python_dispatcher``: our gloo operations started inside a compile leave its dispatcher).
    enqueue_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    # agreements.compiler: the id of the compile in progress ("0/1"), None outside one.
    compile_id: Callable[[], str | None] = _nothing
    # agreements.guard: whether torch's profiler is on (a plain read: the guard hook's path).
    profiler_enabled: Callable[[], bool] = _false
    # agreements.guard_frames: torch's wrapper code objects -> the local holding the target, and
    # the test for Dynamo's output code.
    wrapper_locals: Mapping[Any, str] = dataclasses.field(default_factory=dict)
    is_dynamo_output_code: Callable[[Any], bool] = _false
    # agreements.fingerprint: how a ``group_name`` argument is shown and compared, torch's
    # operator types (``torch.ops.aten.add.Tensor``'s and ``torch.ops.aten.add``'s) and
    # torch.fx's ``normalize_function`` (None: compare arguments by position).
    resolve_group: Callable[[Any], str] = _group_name
    op_overload: type | tuple[type, ...] = ()
    op_overload_packet: type | tuple[type, ...] = ()
    normalize: Callable[..., Any] | None = None


view = TorchView()


def adopt(new: TorchView) -> None:
    """Make ``new`` (the Dynamo wiring built it) what every user reads from now on."""
    global view
    view = new
