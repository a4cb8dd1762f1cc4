"""A canonical fingerprint of one compiled FX graph: its collectives in order, and a hash of the rest.

Every rank computes one for each graph it is about to run (``audit.py``
exchanges them). A fingerprint has two parts:

* ``collectives`` (must match across ranks): every communication op of the
  graph in execution (node) order, including ops inside subgraphs a
  higher-order op calls (checkpointed regions, autograd.Function bodies). An
  entry holds the op, its group (the member ranks where the group name can be
  resolved), its reduce op, the dtype and shape of each tensor it sends, and
  its other arguments (``group_size``, ``src``, ...). Waits are not entries:
  they move no data between ranks.
* ``graph_hash`` (report only): 8 bytes of BLAKE2b over every node's op,
  target, arguments and output dtype/shape.

Symbols are renamed in order of first use, graph inputs first (``s77`` on one
rank and ``s3`` on another both read ``s0``). Left out everywhere because it
may legitimately differ by rank: node names, stack traces and other metadata,
device indices (``cuda:0`` vs ``cuda:1``), process-group names (collectives
carry their ranks instead), size hints (only symbolic sizes are seen), and
object identities. For ops with per-rank split sizes (``all_to_all_single``)
only the number of splits and the non-leading dims are compared.

Plain ``torch.fx``: nothing here reads torch's internals. What it needs of
them (the operator types, ``normalize_function``, resolving a group name to
its ranks) are rows of the seam table, handed over at install
(``torch_view``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

from .. import torch_view

# Namespaces whose ops move data between ranks. Each has a row in the seam table
# (``ops.<namespace>``) but ``c10d_functional``, which registers no op in the
# supported releases and is kept so a graph naming it still counts.
COMM_NAMESPACES = frozenset(
    {"_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "c10d", "_dtensor", "symm_mem"}
)
# Ops in those namespaces that communicate nothing.
_SILENT = frozenset({"wait_tensor", "wait", "name"})

_DIGEST = 8  # bytes


@dataclasses.dataclass(frozen=True)
class Collective:
    """One communication op of a graph. ``where`` is report only (paths differ across hosts)."""

    op: str
    group: str
    reduce_op: str
    tensors: tuple[str, ...]
    args: str
    where: str

    def key(self) -> tuple[str, str, str, tuple[str, ...], str]:
        return (self.op, self.group, self.reduce_op, self.tensors, self.args)

    def render(self) -> str:
        op = f"{self.op}({self.reduce_op})" if self.reduce_op else self.op
        parts = [op, f"on {self.group}"]
        if self.tensors:
            parts.append(", ".join(self.tensors))
        if self.args:
            parts.append(self.args)
        text = " ".join(parts[:2]) + ("; " + "; ".join(parts[2:]) if parts[2:] else "")
        return f"{text} (at {self.where})" if self.where else text


@dataclasses.dataclass
class GraphFingerprint:
    level: str
    collectives: list[Collective]
    graph_hash: bytes
    nodes: int


def collectives_digest(collectives: list[Collective]) -> bytes:
    """8 bytes identifying the must-match part of an ordered collective list."""
    h = hashlib.blake2b(digest_size=_DIGEST)
    for c in collectives:
        h.update("\x1f".join((c.op, c.group, c.reduce_op, "\x1d".join(c.tensors), c.args)).encode())
        h.update(b"\x1e")
    return h.digest()


# ------------------------------------------------------------------ symbols

_SYMBOL = re.compile(r"\b([a-z]+)(\d+)\b")


class _Symbols:
    """Renames symbols in order of first use: s77, s3 -> s0, s1 (u5 -> u0, ...)."""

    __slots__ = ("counts", "names")

    def __init__(self) -> None:
        self.names: dict[str, str] = {}
        self.counts: dict[str, int] = {}

    def _rename(self, m: re.Match[str]) -> str:
        found = m.group(0)
        name = self.names.get(found)
        if name is None:
            prefix = m.group(1)
            n = self.counts.get(prefix, 0)
            self.counts[prefix] = n + 1
            name = self.names[found] = f"{prefix}{n}"
        return name

    def expr(self, value: Any) -> str:
        return _SYMBOL.sub(self._rename, str(value))


def _dim(d: Any, sym: _Symbols) -> str:
    return str(d) if type(d) is int else sym.expr(d)


def _tensor_text(value: Any, sym: _Symbols, *, skip_leading: bool = False) -> str:
    if isinstance(value, torch.Tensor):
        dims = [_dim(d, sym) for d in value.shape]
        if skip_leading and dims:
            dims[0] = "*"
        return f"{str(value.dtype).removeprefix('torch.')}[{', '.join(dims)}]"
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return sym.expr(value)
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_tensor_text(v, sym, skip_leading=skip_leading) for v in value) + ")"
    if value is None or isinstance(value, (int, float, bool)):
        return repr(value)
    return type(value).__qualname__


def _meta_value(node: torch.fx.Node) -> Any:
    meta = node.meta
    return meta["val"] if "val" in meta else meta.get("example_value")


# ------------------------------------------------------------------ source lines

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in ([^\n]+)\n(?:[ \t]+([^\n]*)\n)?')
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OUR_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_line(stack_trace: str | None) -> str:
    """The innermost frame of a node's stack trace outside torch: 'file:line in fn: code'."""
    if not stack_trace:
        return ""
    frames = _FRAME.findall(stack_trace)
    if not frames:
        return ""
    chosen = frames[-1]
    for frame in reversed(frames):
        if not frame[0].startswith((_TORCH_DIR, _OUR_DIR)):
            chosen = frame
            break
    path, line, fn, code = chosen
    text = f"{path}:{line} in {fn.strip()}"
    return f"{text}: {code.strip()}" if code.strip() else text


# ------------------------------------------------------------------ targets


def _op_name(target: Any) -> str | None:
    """'namespace.op.overload' for an operator, None for anything else."""
    if isinstance(target, torch_view.view.op_overload):
        return str(target)
    if isinstance(target, torch_view.view.op_overload_packet):
        packet: Any = target
        name = str(packet)
        return f"{name}.default" if "default" in packet.overloads() else name
    return None


def _target_text(target: Any) -> str:
    if isinstance(target, str):
        return target
    op = _op_name(target)
    if op is not None:
        return op
    module = getattr(target, "__module__", None) or ""
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if qualname is None:
        return type(target).__qualname__
    return f"{module}.{qualname}" if module else qualname


def _is_communication(op: str | None) -> bool:
    if op is None:
        return False
    namespace, _, rest = op.partition(".")
    return namespace in COMM_NAMESPACES and rest.partition(".")[0] not in _SILENT


# ------------------------------------------------------------------ the walk


class _Walk:
    """One pass over a graph (and the subgraphs it calls), building both parts."""

    def __init__(self) -> None:
        self.sym = _Symbols()
        self.collectives: list[Collective] = []
        self.hash = hashlib.blake2b(digest_size=_DIGEST)
        self.nodes = 0

    # Canonical text of an argument. Node references are positions.
    def canon(self, v: Any, index: dict[torch.fx.Node, int]) -> str:
        if isinstance(v, torch.fx.Node):
            return f"%{index.get(v, -1)}"
        if v is None or isinstance(v, (bool, int, str)):
            return repr(v)
        if isinstance(v, float):
            return repr(v)
        if isinstance(v, (list, tuple)):
            inner = ",".join(self.canon(x, index) for x in v)
            return f"[{inner}]" if isinstance(v, list) else f"({inner})"
        if isinstance(v, dict):
            return "{" + ",".join(f"{k!r}:{self.canon(x, index)}" for k, x in v.items()) + "}"
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return self.sym.expr(v)
        if isinstance(v, torch.dtype):
            return str(v)
        if isinstance(v, torch.device):
            return f"device({v.type})"  # the index is per rank
        if isinstance(v, (torch.memory_format, torch.layout)):
            return str(v)
        if isinstance(v, torch.Tensor):
            return "tensor:" + _tensor_text(v, self.sym)
        if isinstance(v, slice):
            return f"slice({self.canon(v.start, index)},{self.canon(v.stop, index)},{self.canon(v.step, index)})"
        if callable(v):
            return _target_text(v)
        return type(v).__qualname__  # opaque objects: their type, never their address

    def collective(self, node: torch.fx.Node, op: str) -> Collective:
        bound = None
        normalize = torch_view.view.normalize
        try:
            if normalize is not None:
                bound = normalize(node.target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True)
        except Exception:  # noqa: BLE001 - an unusual schema: fall back to positions
            bound = None
        if bound is not None:
            items = dict(bound.kwargs)
        else:
            items = {f"arg{i}": a for i, a in enumerate(node.args)}
            items.update(node.kwargs)
        per_rank_splits = any(k.endswith("split_sizes") and v is not None for k, v in items.items())
        group = ""
        reduce_op = ""
        tensors: list[str] = []
        rest: list[str] = []
        for key, value in items.items():
            if key == "group_name":
                group = torch_view.view.resolve_group(value)
            elif key == "ranks" and isinstance(value, (list, tuple)):
                group = f"ranks {list(value)}"
            elif key == "tag":
                continue
            elif key in ("reduce_op", "reduceOp"):
                reduce_op = str(value).lower()
            elif key.endswith("split_sizes"):
                rest.append(f"{key}={'None' if value is None else f'<{len(value)} per-rank sizes>'}")
            elif _holds_nodes(value):
                for n in _nodes(value):
                    tensors.append(_tensor_text(_meta_value(n), self.sym, skip_leading=per_rank_splits))
            else:
                rest.append(f"{key}={self.canon(value, {})}")
        return Collective(
            op=op,
            group=group or "the default group",
            reduce_op=reduce_op,
            tensors=tuple(tensors),
            args=", ".join(rest),
            where=user_line(node.meta.get("stack_trace")),
        )

    def graph(self, gm: torch.fx.GraphModule, depth: int = 0) -> None:
        index: dict[torch.fx.Node, int] = {}
        update = self.hash.update
        update(f"graph {depth}\n".encode())
        nodes = list(gm.graph.nodes)
        # Placeholders first, so symbols are numbered from the graph's inputs.
        for node in nodes:
            if node.op == "placeholder":
                index[node] = len(index)
                update(f"in {_tensor_text(_meta_value(node), self.sym)}\n".encode())
        for node in nodes:
            if node.op == "placeholder":
                continue
            index[node] = len(index)
            self.nodes += 1
            target = node.target
            op = _op_name(target) if node.op == "call_function" else None
            if op is not None and _is_communication(op):
                c = self.collective(node, op)
                self.collectives.append(c)
                update(f"C {'|'.join(c.key()[:3])}|{'|'.join(c.tensors)}|{c.args}\n".encode())
                continue
            if node.op in ("call_function", "call_module"):
                for sub in _called_subgraphs(gm, node):
                    self.graph(sub, depth + 1)
            args = self.canon(node.args, index)
            kwargs = self.canon(node.kwargs, index) if node.kwargs else ""
            out = _tensor_text(_meta_value(node), self.sym) if node.op != "output" else ""
            update(f"{node.op} {_target_text(target)} {args} {kwargs} -> {out}\n".encode())


def _holds_nodes(value: Any) -> bool:
    if isinstance(value, torch.fx.Node):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(v, torch.fx.Node) for v in value)


def _nodes(value: Any) -> Iterator[torch.fx.Node]:
    if isinstance(value, torch.fx.Node):
        yield value
    else:
        for v in value:
            if isinstance(v, torch.fx.Node):
                yield v


def _called_subgraphs(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Iterator[torch.fx.GraphModule]:
    """GraphModules a node runs: a call_module target, or get_attr arguments of a higher-order op."""
    candidates: list[str] = []
    if node.op == "call_module":
        candidates.append(str(node.target))
    for arg in node.args:
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
            candidates.append(str(arg.target))
    for name in candidates:
        try:
            sub = gm.get_submodule(name)
        except AttributeError:
            continue
        if isinstance(sub, torch.fx.GraphModule):
            yield sub


def fingerprint(gm: torch.fx.GraphModule, level: str) -> GraphFingerprint:
    """The fingerprint of ``gm`` as the graph at ``level`` ("dynamo", "aot_forward", ...)."""
    walk = _Walk()
    walk.graph(gm)
    return GraphFingerprint(level, walk.collectives, walk.hash.digest(), walk.nodes)
