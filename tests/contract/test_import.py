"""Importing the package runs ``runtime.install()`` once and nothing else; imported but off, it is torch alone.

* A fresh interpreter imports the package (or one of its modules, or torch with
  autoload on) under a watch set up before anything of ours is imported: every
  read of the environment and every hook registered by our code is recorded,
  with whether ``runtime.install()`` was running, and the calls of ``install``
  and of ``config.load_from_env`` are counted. One install, one reading of the
  settings, inside it, and the fork handler registered there only.
* The composition root and the package's ``__init__`` hold no module-level
  state but the runtime (which lists every other module's: test_runtime_state),
  shown able to fail on a mutation; ``tests/contract/test_layering.py`` checks that no
  module calls anything when imported but the root's one ``install()``.
* Two gloo ranks with different shapes compile the same graphs, and recompile
  alike, with the package imported but not enabled as with torch alone, and
  our counters show no collective.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.contract.test_layering import TOP, TREE
from tests.fixtures import REPO, clean_env
from tests.harness import run_ranks
from tests.rankside import GraphRecorder
from tests.unit.test_runtime_state import module_mutables

# The multi-process tests here: torch seam (tests/tiers.py).
pytestmark = pytest.mark.torch_seam

# What the watched interpreter runs before anything else: the watch on the environment, on hook
# registrations and on the two functions counted, then the import the test names.
WATCH = r"""
import atexit, importlib.abc, json, os, sys

PKG = os.path.join(os.getcwd(), "compiler_collectives") + os.sep
calls = {"install": 0, "load_from_env": 0}
inside = {"install": 0}
events = []  # [what, key, inside install]
STDLIB = ("os.py", "_collections_abc.py", "<frozen os>", "<frozen _collections_abc>")  # get(), `in`, getenv


def ours(depth):
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.endswith(STDLIB):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(PKG)


class Environ(type(os.environ)):
    def __getitem__(self, key):
        if ours(2):
            events.append(["read", key, inside["install"] > 0])
        return super().__getitem__(key)

    def __iter__(self):
        if ours(2):
            events.append(["read", "*", inside["install"] > 0])
        return super().__iter__()


watched = Environ.__new__(Environ)
watched.__dict__.update(os.environ.__dict__)
os.environ = watched


def hook(name, register):
    def registering(*args, **kwargs):
        if ours(2):
            events.append(["hook", name, inside["install"] > 0])
        return register(*args, **kwargs)

    return registering


os.register_at_fork = hook("register_at_fork", os.register_at_fork)
atexit.register = hook("atexit", atexit.register)
sys.addaudithook = hook("audit", sys.addaudithook)


def counted(name, fn, track=False):
    def call(*args, **kwargs):
        calls[name] += 1
        inside["install"] += track
        try:
            return fn(*args, **kwargs)
        finally:
            inside["install"] -= track

    return call


WRAP = {
    "compiler_collectives.runtime": ("install", True),
    "compiler_collectives.config": ("load_from_env", False),
}


class Watch(importlib.abc.MetaPathFinder):
    # Wrap a function of ours as soon as its module has run, before anything calls it.
    def find_spec(self, name, path, target=None):
        if name not in WRAP:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(name, path, target)
            if spec is not None:
                break
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            attr, track = WRAP[name]
            setattr(module, attr, counted(attr, getattr(module, attr), track))

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, Watch())
"""


def _watched(statement: str, **env: str) -> dict:
    """What our code did while a fresh interpreter ran ``statement``, then ``enable()``."""
    code = WATCH + textwrap.dedent(f"""
        {statement}
        import compiler_collectives as cc
        from compiler_collectives import config, runtime
        at_import = dict(calls)
        cc.enable()
        print(json.dumps({{
            "at_import": at_import,
            "after_enable": calls,
            "events": events,
            "timeout_s": config.settings.timeout_s,
            "same_settings": runtime.current().settings is config.settings,
        }}))
        """)
    environment = clean_env(**env)
    environment["PYTHONPATH"] = REPO
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=environment, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("statement", "env"),
    [
        # The package and the submodule import our code the same way on every release: the
        # autoload case, where torch imports us, is the one a release can change.
        pytest.param(
            "import compiler_collectives", {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}, marks=pytest.mark.release_independent
        ),
        # a submodule: Python runs the package's __init__ first
        pytest.param(
            "import compiler_collectives.transport.groups",
            {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
            marks=pytest.mark.release_independent,
        ),
        # autoload: torch imports the package at `import torch`, as one of our variables asks
        ("import torch", {}),
    ],
    ids=["package", "submodule", "autoload"],
)
def test_importing_runs_install_once_which_alone_reads_the_settings_and_registers_a_hook(statement, env):
    seen = _watched(statement, COMPILER_COLLECTIVES_TIMEOUT="7", **env)
    assert seen["at_import"] == {"install": 1, "load_from_env": 1}
    # enable() installs again (idempotent), but the settings were read once, at the first install
    assert seen["after_enable"] == {"install": 2, "load_from_env": 1}
    assert seen["timeout_s"] == 7.0 and seen["same_settings"]
    outside = [event for event in seen["events"] if not event[2]]
    assert outside == [], f"our code read the environment or registered a hook outside install(): {outside}"
    reads = [key for what, key, _ in seen["events"] if what == "read"]
    assert reads.count("COMPILER_COLLECTIVES_TIMEOUT") == 1
    hooks = [key for what, key, _ in seen["events"] if what == "hook"]
    assert hooks == ["register_at_fork"]


# ------------------------------------------------- no state but the runtime


def check_root_state(tree: dict) -> list[str]:
    """The package's ``__init__`` holds no module-level state; the composition root holds one, the runtime."""
    expected = {TOP: set(), f"{TOP}.runtime": {"_runtime"}}
    offences = []
    for module, names in expected.items():
        found = set(module_mutables(tree[module].text))
        offences += [f"{tree[module].shown} holds {name} besides the runtime" for name in sorted(found - names)]
    return offences


def test_the_package_root_holds_no_state_but_the_runtime():
    assert check_root_state(TREE) == []


@pytest.mark.parametrize(
    ("module", "snippet"),
    [
        (TOP, "_enabled_once = []\n"),
        (f"{TOP}.runtime", "_installs = 0\ndef _count():\n    global _installs\n    _installs += 1\n"),
        (f"{TOP}.runtime", "import threading\n_local = threading.local()\n"),
    ],
)
def test_the_root_state_check_flags_a_second_piece_of_state(module, snippet):
    from tests.contract.test_layering import mutated

    offences = check_root_state(mutated(module, snippet))
    assert offences and all("(mutated)" in o for o in offences), offences


# ------------------------------------------------- imported, not enabled: torch alone


def _fn(x: torch.Tensor) -> torch.Tensor:
    return x.cos().sum(0)


def compile_shapes_per_rank(rank: int, world: int, imported: bool) -> dict:
    """Each rank its own shapes: a first size, a second (torch marks the dim dynamic), a third."""
    before = None
    if imported:
        import compiler_collectives as cc  # installed, not enabled

        before = cc.stats()
    rec = GraphRecorder()
    f = torch.compile(_fn, backend=rec)
    outs = [f(torch.ones(n + rank, 3)) for n in (4, 6, 6, 9)]
    result = {
        "graphs": rec.graphs,
        "symbolic_ints": rec.symbolic_ints,
        "unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "ok": all(torch.allclose(o, _fn(torch.ones(n + rank, 3))) for o, n in zip(outs, (4, 6, 6, 9))),
        "package_loaded": "compiler_collectives" in sys.modules,
    }
    if imported:
        import compiler_collectives as cc

        result["stats_before"], result["stats_after"] = before, cc.stats()
        result["enabled"] = cc.is_enabled() or cc.guards_enabled()
    return result


@pytest.mark.multiprocess
def test_with_the_package_imported_but_not_enabled_a_compiled_job_behaves_as_torch_alone():
    alone = run_ranks(compile_shapes_per_rank, 2, args=(False,)).results
    imported = run_ranks(compile_shapes_per_rank, 2, args=(True,)).results
    for rank in range(2):
        assert not alone[rank]["package_loaded"] and imported[rank]["package_loaded"]
        assert alone[rank]["ok"] and imported[rank]["ok"]
        for key in ("graphs", "symbolic_ints", "unique_graphs"):
            assert imported[rank][key] == alone[rank][key], (rank, key, imported[rank], alone[rank])
        # torch alone: one static graph, then one dynamic recompile
        assert alone[rank]["graphs"] == [[[4 + rank, 3]], [["s", 3]]]
        assert not imported[rank]["enabled"]
        # our counters and records did not move: no collective, no group, no compile-once record
        after = imported[rank]["stats_after"]
        assert after == imported[rank]["stats_before"]
        assert after["compiler_collectives"] == after["guard_collectives"] == after["audit_exchanges"] == 0
        assert after["guard_transport"] is None
