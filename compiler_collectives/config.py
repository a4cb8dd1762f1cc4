"""Every setting of compiler_collectives in one place: env var, default, meaning.

Each setting is read from its environment variable once, by ``load()``, which
the package's ``install()`` (``runtime.py``) runs before anything else: not
when this module is imported, so nothing reads a setting before install and
a rank's environment is read as it is when the package installs. Afterwards
a setting can be changed from Python through ``set_value`` or temporarily
with ``override(...)``.
``docs/configuration.md`` mirrors the table below; keep them in step.

Torch's own switch for compiler collectives, ``TORCH_COMPILER_COLLECTIVES``,
is not ours: torch reads it into ``torch._dynamo.config.enable_compiler_collectives``
and we read that flag directly, so there is exactly one source of truth for it.
Likewise our log levels: ``TORCH_LOGS=compiler_collectives`` (INFO) or
``TORCH_LOGS=+compiler_collectives`` (DEBUG) configures our loggers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from .errors import ConfigError

log = logging.getLogger("compiler_collectives.config")


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name}={raw!r}: expected 1/0, true/false, yes/no or on/off")


N = TypeVar("N", int, float)


def _parse_number(name: str, raw: str, kind: Callable[[str], N], what: str, allow_zero: bool) -> N:
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected {what}") from None
    if value < 0 or (value == 0 and not allow_zero) or value != value:  # value != value: NaN
        raise ConfigError(f"{name}={raw!r}: must be {'0 or more' if allow_zero else 'greater than 0'}")
    return value


def _parse_positive_float(name: str, raw: str) -> float:
    return _parse_number(name, raw, float, "a number of seconds", allow_zero=False)


def _parse_nonnegative_float(name: str, raw: str) -> float:
    return _parse_number(name, raw, float, "a number of seconds", allow_zero=True)


def _parse_positive_int(name: str, raw: str) -> int:
    return _parse_number(name, raw, int, "a whole number", allow_zero=False)


MIN_CHUNK_BYTES = 4096


def _parse_chunk_bytes(name: str, raw: str) -> int:
    value = _parse_positive_int(name, raw)
    if value < MIN_CHUNK_BYTES:
        raise ConfigError(f"{name}={raw!r}: must be {MIN_CHUNK_BYTES} or more")
    return value


def _parse_str(name: str, raw: str) -> str:
    return raw


def _parse_guard_transport(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if value not in GUARD_TRANSPORTS:
        raise ConfigError(f"{name}={raw!r}: expected one of {', '.join(GUARD_TRANSPORTS)}")
    return value


GUARD_TRANSPORTS = ("auto", "gloo")

SCOPE_LAYOUTS = ("consecutive", "strided")


def _parse_scope(name: str, raw: str) -> str:
    """'' (the whole world), or 'consecutive:N' / 'strided:N' with N pipeline stages."""
    value = raw.strip().lower()
    if value in ("", "world"):
        return ""
    layout, _, stages = value.partition(":")
    if layout not in SCOPE_LAYOUTS or not stages.isdigit() or int(stages) < 1:
        raise ConfigError(
            f"{name}={raw!r}: expected world, consecutive:<stages> or strided:<stages> "
            "(e.g. consecutive:4 for 4 pipeline stages of consecutive ranks)"
        )
    return f"{layout}:{int(stages)}"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of the settings table.

    ``must_match``: the setting shapes a collective (what travels, how, or
    whether it runs), so every rank must hold the same value. The ranks
    compare every such setting when our groups are created and all raise
    ``SetupMismatchError`` naming each difference (``setup_agreement``). This
    flag is the only list of them; docs/configuration.md shows it.
    """

    attr: str
    env: str
    default: Any
    parse: Callable[[str, str], Any]
    meaning: str
    must_match: bool = False


SETTINGS_TABLE: tuple[Setting, ...] = (
    Setting(
        "guards",
        "COMPILER_COLLECTIVES_GUARDS",
        False,
        _parse_bool,
        "Run the guard collective on every call of a compiled frame: if any rank "
        "misses its guards, every rank recompiles. Same effect as "
        "torch.compiler.set_enable_guard_collectives(True).",
        must_match=True,
    ),
    Setting(
        "guard_transport",
        "COMPILER_COLLECTIVES_GUARD_TRANSPORT",
        "auto",
        _parse_guard_transport,
        "How the guard collective's ranks agree. auto: through a shared-memory segment among "
        "the ranks of one host (same machine and torchrun agent), and between hosts by one "
        "leader per host in log2(hosts) rounds; falls back to gloo, with one log line, where "
        "shared memory cannot be used. gloo: one all-reduce over a gloo group of every rank.",
        must_match=True,
    ),
    Setting(
        "guard_desync_check",
        "COMPILER_COLLECTIVES_GUARD_DESYNC_CHECK",
        True,
        _parse_bool,
        "Let the guard collective also verify that every rank is entering the same compiled "
        "frame at the same call (two int64 per call instead of one; about 50 µs more per call "
        "on a 2-core gloo host). Off: hit/miss agreement only. Applies to the gloo guard "
        "transport only: on shared memory the check is always on, at no cost.",
        must_match=True,
    ),
    Setting(
        "scope",
        "COMPILER_COLLECTIVES_SCOPE",
        "",
        _parse_scope,
        "Which ranks make their agreements together (compiler and guard collectives, audit, "
        "recompile reasons): empty or world: every rank. consecutive:N: N pipeline stages, each a "
        "block of world/N consecutive ranks (torchtitan's mesh order, pp outermost: stage = "
        "rank // (world/N)). strided:N: stage = rank % N. compiler_collectives.scope(group) "
        "overrides it. The setup check still covers every rank.",
        must_match=True,
    ),
    Setting(
        "timeout_s",
        "COMPILER_COLLECTIVES_TIMEOUT",
        300.0,
        _parse_positive_float,
        "Seconds any of our collectives (and the creation of our process groups) may "
        "wait for the slowest rank before raising CollectiveTimeoutError. Must cover "
        "the compile-time skew between ranks.",
    ),
    Setting(
        "max_payload_bytes",
        "COMPILER_COLLECTIVES_MAX_PAYLOAD_BYTES",
        16 * 1024 * 1024,
        _parse_positive_int,
        "Largest compiler-collective payload one rank may send or accept; checked before any buffer is allocated.",
        must_match=True,
    ),
    Setting(
        "inline_slot_bytes",
        "COMPILER_COLLECTIVES_INLINE_SLOT_BYTES",
        4096,
        _parse_positive_int,
        "Size of each rank's slot in the first all-gather round. Payloads that fit "
        "cost one collective; larger ones a second, exactly sized round.",
        must_match=True,
    ),
    Setting(
        "skip_needless_restart",
        "COMPILER_COLLECTIVES_SKIP_NEEDLESS_RESTART",
        True,
        _parse_bool,
        "After the compiler collective, skip Dynamo's restart when no rank's "
        "automatic-dynamic decision would change (torch always restarts).",
        must_match=True,
    ),
    Setting(
        "exchange_inputs_first",
        "COMPILER_COLLECTIVES_EXCHANGE_INPUTS_FIRST",
        True,
        _parse_bool,
        "Before a frame's first trace, exchange the sizes of its tensor and int arguments, "
        "so that dims differing across ranks are dynamic in the first trace already and no "
        "second trace is needed (one extra small collective per compile). Off: the first "
        "trace is an all-static preflight, as in torch.",
        must_match=True,
    ),
    Setting(
        "audit",
        "COMPILER_COLLECTIVES_AUDIT",
        True,
        _parse_bool,
        "While compiler collectives are on, audit every compiled graph: after each compile (and "
        "at the first backward of a graph whose backward compiles lazily) the ranks exchange a "
        "fingerprint of the collectives the graph will run (op, group, reduce op, dtype, shape, "
        "in order); if they differ, every rank raises ProgramDivergenceError before any rank runs "
        "the graph. One small all-gather per compiled graph. 0: off.",
        must_match=True,
    ),
    Setting(
        "entry_check",
        "COMPILER_COLLECTIVES_ENTRY_CHECK",
        True,
        _parse_bool,
        "While the audit and the guard collective are on, check on every call of a frame whose "
        "cache entries run different collectives that every rank is about to run an entry with "
        "the same collective program; if not, every rank raises ProgramDivergenceError before "
        "running it. Frames whose entries all run the same collectives (nearly all) pay one "
        "attribute read per call. 0: off.",
        must_match=True,
    ),
    Setting(
        "compile_once",
        "COMPILER_COLLECTIVES_COMPILE_ONCE",
        True,
        _parse_bool,
        "While compiler collectives are on, compile each cacheable graph (inductor with "
        "AOTAutograd's cache) once per job: at AOTAutograd's cache lookup the ranks exchange "
        "their cache keys; among the ranks whose keys match, a rank that holds the entry serves "
        "it, or one rank compiles, and the others wait for it inside the backend, check the "
        "artifact against its SHA-256 digests and load it. Graphs that are not cacheable, keys "
        "that differ, and graphs whose compile runs torch's own compile-time collectives compile "
        "on every rank, as without it. 0: every rank compiles every graph.",
        must_match=True,
    ),
    Setting(
        "compile_timeout_s",
        "COMPILER_COLLECTIVES_COMPILE_TIMEOUT",
        3600.0,
        _parse_positive_float,
        "Seconds a rank waits for the rank that compiles a graph for it (compile once), or for "
        "a rank that did not load it and compiles it itself, while that rank is alive, before "
        "raising CompileOnceError (CompileTimeoutError for the audit's recompile without "
        "caches). Waiting ranks log every 30 s; a compiling rank that dies, or whose compile "
        "raises, ends the wait at once.",
    ),
    Setting(
        "max_artifact_bytes",
        "COMPILER_COLLECTIVES_MAX_ARTIFACT_BYTES",
        1024 * 1024 * 1024,
        _parse_positive_int,
        "Largest compiled artifact (cache entries and kernel binaries of one graph) a rank "
        "accepts from the rank that compiled it; larger ones are refused before any buffer "
        "is allocated, and that rank compiles the graph itself.",
    ),
    Setting(
        "once_fanout",
        "COMPILER_COLLECTIVES_ONCE_FANOUT",
        2,
        _parse_positive_int,
        "How many cache dirs one rank sends a compiled artifact to (compile once): the rank that "
        "compiled it sends to this many, each of them forwards to this many, and so on: a tree over "
        "the job's cache dirs, one receiving rank per dir. 1: a chain.",
        must_match=True,
    ),
    Setting(
        "once_chunk_bytes",
        "COMPILER_COLLECTIVES_ONCE_CHUNK_BYTES",
        1024 * 1024,
        _parse_chunk_bytes,
        "Bytes per piece of a compiled artifact on its way down the tree (compile once): a rank "
        "checks each piece's SHA-256 before it forwards it, so the tree's depth adds one piece's "
        "time per level, not the artifact's. The sending rank's value is used; 4096 or more.",
    ),
    Setting(
        "heartbeat_s",
        "COMPILER_COLLECTIVES_HEARTBEAT_S",
        1.0,
        _parse_nonnegative_float,
        "Seconds between heartbeats a background thread writes to the c10d store, so "
        "that a failing rank can name which peers are absent (crashed, killed, stopped) "
        "and which are alive elsewhere (desync). The same thread watches for other ranks' "
        "failure reports, so a rank waiting in one of our gloo collectives stops within "
        "about one heartbeat of another rank's failure. 0 disables the thread; errors then "
        "name an absent rank only where its connection broke (a process that ended) or, "
        "waiting for a compile, where /proc shows its process gone; only same-host peers "
        "on shared memory hear of a failure before their timeout, and a rank waiting for a "
        "compile cannot tell a store that stopped answering from a long compile. Silence alone never ends "
        "compile once's wait: a silent rank on another host is waited for, with a warning "
        "every 30 s, up to COMPILER_COLLECTIVES_COMPILE_TIMEOUT.",
    ),
    Setting(
        "timing",
        "COMPILER_COLLECTIVES_TIMING",
        False,
        _parse_bool,
        "Record every collective's duration and bytes in memory; at process exit each "
        "rank logs a one-screen summary (count, total, p50/p90/p99/max, bytes, late ranks).",
    ),
    Setting(
        "trace_dir",
        "COMPILER_COLLECTIVES_TRACE_DIR",
        "",
        _parse_str,
        "Directory where each rank writes rank{N}.json, a Chrome trace (Perfetto, "
        "chrome://tracing) with one event per collective. Implies recording. Merge with "
        "`python -m compiler_collectives report DIR`.",
    ),
)


MUST_MATCH: tuple[Setting, ...] = tuple(row for row in SETTINGS_TABLE if row.must_match)
"""The settings every rank must hold alike (derived from the flags above)."""


# Current values, one attribute per row (``Setting.attr``), defaults from the
# table: each default is declared once, in its row. ``sources`` says where
# each value came from ("default", "env", "api"), for `doctor`.
Settings = dataclasses.make_dataclass(
    "Settings",
    [(row.attr, type(row.default), dataclasses.field(default=row.default)) for row in SETTINGS_TABLE]
    + [("sources", dict, dataclasses.field(default_factory=dict))],
)
Settings.__doc__ = "Current values of every setting; attribute names match ``Setting.attr``."
Settings.__module__ = __name__


PREFIX = "COMPILER_COLLECTIVES_"
AUTOLOAD_ENV = "COMPILER_COLLECTIVES_AUTOLOAD"
# Read by something other than the settings table: autoload's switch, the
# retired log-level variable (a warning at import says so), and scripts/dev's
# venv cache. Every other COMPILER_COLLECTIVES_* name is a typo.
OTHER_VARIABLES = (AUTOLOAD_ENV, "COMPILER_COLLECTIVES_LOG_LEVEL", "COMPILER_COLLECTIVES_VENV_CACHE")


def known_variables() -> tuple[str, ...]:
    return tuple(row.env for row in SETTINGS_TABLE) + OTHER_VARIABLES


def check_names(environ: Mapping[str, str] | None = None) -> None:
    """Raise ``ConfigError`` for a ``COMPILER_COLLECTIVES_*`` variable we do not know.

    A misspelt name (``COMPILER_COLLECTIVES_GAURDS=1``) would otherwise be
    ignored, and that rank would run with the default while its peers do not.
    """
    if environ is None:
        environ = os.environ
    known = known_variables()
    for name in sorted(environ):
        if name.startswith(PREFIX) and name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else f"the known ones are {', '.join(known)}"
            raise ConfigError(
                f"{name} is not a compiler_collectives variable: {hint} (docs/configuration.md lists them)"
            )


def load_from_env(environ: Mapping[str, str] | None = None) -> Any:
    """Build a fresh Settings from ``environ`` (``os.environ`` by default).

    Raises ``ConfigError`` naming the variable for a value that does not parse
    or a ``COMPILER_COLLECTIVES_*`` name that is not ours."""
    if environ is None:
        environ = os.environ
    check_names(environ)
    if AUTOLOAD_ENV in environ:
        _parse_bool(AUTOLOAD_ENV, environ[AUTOLOAD_ENV])
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for row in SETTINGS_TABLE:
        raw = environ.get(row.env)
        if raw is None:
            values[row.attr] = row.default
            sources[row.attr] = "default"
        else:
            values[row.attr] = row.parse(row.env, raw)
            sources[row.attr] = "env"
    return Settings(**values, sources=sources)


settings: Any = None
"""The current values (a ``Settings``): None until ``load()``, which install runs first."""


def load() -> Any:
    """Read every setting from the environment (install runs this, once) and make it current.

    Raises ``ConfigError`` as ``load_from_env`` does; the current values are then left as they were.
    """
    global settings
    settings = load_from_env()
    return settings


def set_value(attr: str, value: Any, source: str = "api") -> None:
    """Assign a setting and remember where it came from."""
    if not any(row.attr == attr for row in SETTINGS_TABLE):
        raise AttributeError(f"no setting named {attr!r}")
    setattr(settings, attr, value)
    settings.sources[attr] = source


@contextlib.contextmanager
def override(**values: Any) -> Iterator[Any]:
    """Temporarily change settings (tests, benchmarks)."""
    saved = {k: getattr(settings, k) for k in values}
    saved_sources = dict(settings.sources)
    try:
        for key, value in values.items():
            set_value(key, value)
        yield settings
    finally:
        for key, value in saved.items():
            setattr(settings, key, value)
        settings.sources.clear()
        settings.sources.update(saved_sources)
