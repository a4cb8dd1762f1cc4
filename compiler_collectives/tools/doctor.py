"""`python -m compiler_collectives doctor`: is everything in place, and what is switched on?

``collect()`` gathers the facts as a dict (usable from inside a job too);
``render()`` prints them with a fix for every problem; ``problems()`` lists
what is missing. Exit status of the command: 0 healthy, 1 something needed is
missing.
"""

from __future__ import annotations

import os
from typing import Any

from .. import config
from ..errors import UnsupportedTorchError
from ..version import __version__

install_error: UnsupportedTorchError | None = None
"""What installing into ``torch._dynamo`` raised when the package was imported to run
``doctor`` (which reports a broken install instead of dying of it); the package's
``__init__``, above this module, hands it over with ``set_install_error``."""


def set_install_error(error: UnsupportedTorchError | None) -> None:
    global install_error
    install_error = error


def _autoload_facts() -> dict[str, Any]:
    from importlib.metadata import entry_points

    registered = any(
        ep.value.startswith("compiler_collectives_autoload") for ep in entry_points(group="torch.backends")
    )
    torch_autoload = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "1"
    try:
        import compiler_collectives_autoload as autoload

        wanted = autoload.wanted()
        status = autoload.status
    except ImportError:
        wanted, status = False, None
    return {
        "entry_point_registered": registered,
        "torch_autoload_enabled": torch_autoload,
        "env_requests_activation": wanted,
        "status_at_import_torch": status,
    }


def _switch_sources() -> dict[str, Any]:
    from .. import dynamo as dynamo_seams

    env_flag = os.environ.get("TORCH_COMPILER_COLLECTIVES")
    flag = dynamo_seams.compiler_collectives_flag()
    if env_flag is not None and (env_flag == "1") == flag:
        flag_source = "env TORCH_COMPILER_COLLECTIVES"
    elif flag:
        flag_source = "Python (compiler_collectives.enable() or torch._dynamo.config)"
    else:
        flag_source = "default (off)"
    guards = dynamo_seams.installed() and dynamo_seams.guard_hook_active()
    env_guards = os.environ.get("COMPILER_COLLECTIVES_GUARDS")
    if guards and env_guards is not None and config.settings.guards:
        guard_source = "env COMPILER_COLLECTIVES_GUARDS"
    elif guards:
        guard_source = "Python (enable(guards=True) or torch.compiler.set_enable_guard_collectives)"
    else:
        guard_source = "default (off)"
    return {
        "compiler_collectives": {"on": flag, "source": flag_source},
        "guard_collectives": {"on": guards, "source": guard_source},
        "settings": {
            row.env: {
                "value": getattr(config.settings, row.attr),
                "source": config.settings.sources.get(row.attr, "default"),
            }
            for row in config.SETTINGS_TABLE
        },
    }


def _groups_facts() -> dict[str, Any]:
    import torch.distributed as dist

    from ..transport import groups

    if not (dist.is_available() and dist.is_initialized()):
        return {"initialized": False}
    out: dict[str, Any] = {
        "initialized": True,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "default_backend": str(dist.get_backend()),
    }
    out["ours"] = {name: str(dist.get_backend(pg)) for name, pg in groups.existing().items()}
    out["guard_transport"] = groups.guard_transport()
    return out


def collect(create_groups: bool = False) -> dict[str, Any]:
    """Every fact doctor reports. ``create_groups`` creates our groups (a collective!)."""
    import torch

    facts: dict[str, Any] = {"torch_version": torch.__version__}
    from .. import dynamo as dynamo_seams

    facts["package_version"] = __version__
    facts["missing_seams"] = dynamo_seams.missing_seams()
    facts["missing_audit_backend_seams"] = dynamo_seams.missing_audit_backend_seams()
    facts["torch_supported"] = dynamo_seams.version_supported()
    facts["supported_range"] = dynamo_seams.supported_range()
    facts["installed"] = dynamo_seams.installed()
    if install_error is not None:
        facts["install_error"] = str(install_error)
    facts["autoload"] = _autoload_facts()
    facts["switches"] = _switch_sources()
    if create_groups:
        import torch.distributed as dist

        from ..agreements import our_groups

        if dist.is_available() and dist.is_initialized():
            our_groups.compile_pg()
            our_groups.guard_pg()
    facts["process_groups"] = _groups_facts()
    return facts


def problems(facts: dict[str, Any]) -> list[str]:
    """Each problem with its fix."""
    out = []
    fix = f"Fix: install a supported torch ({facts['supported_range']})."
    if facts["missing_seams"]:
        out.append(f"torch {facts['torch_version']} lacks Dynamo seam(s) {', '.join(facts['missing_seams'])}. {fix}")
    elif not facts["torch_supported"]:
        out.append(f"torch {facts['torch_version']} is outside the supported releases. {fix}")
    auto = facts["autoload"]
    if not auto["entry_point_registered"]:
        out.append(
            "the torch.backends entry point is not registered, so env vars alone cannot "
            "activate the package. Fix: reinstall it (pip install compiler_collectives)."
        )
    if auto["env_requests_activation"] and not auto["torch_autoload_enabled"]:
        out.append(
            "our environment variables are set but TORCH_DEVICE_BACKEND_AUTOLOAD=0 stops torch "
            "from loading us. Fix: unset it, or `import compiler_collectives` in the script."
        )
    if isinstance(auto["status_at_import_torch"], str) and auto["status_at_import_torch"].startswith("failed"):
        out.append(f"autoload at import torch {auto['status_at_import_torch']}. Fix: see the cause above.")
    return out


def render(facts: dict[str, Any]) -> str:
    lines = [
        f"torch {facts['torch_version']}"
        + ("" if facts["torch_supported"] else f" (NOT supported: {facts['supported_range']})")
    ]
    state = "installed into torch._dynamo" if facts["installed"] else "NOT installed"
    lines.append(f"compiler_collectives {facts['package_version']}: {state}")
    lines.append(
        "Dynamo seams: "
        + ("all present" if not facts["missing_seams"] else "MISSING " + ", ".join(facts["missing_seams"]))
    )
    missing_audit = facts.get("missing_audit_backend_seams", [])
    lines.append(
        "program audit levels beyond Dynamo's graph (AOTAutograd, inductor): "
        + ("seams present" if not missing_audit else "NOT audited, missing " + ", ".join(missing_audit))
    )
    a = facts["autoload"]
    lines.append(
        "autoload: entry point "
        + ("registered" if a["entry_point_registered"] else "NOT registered")
        + f"; torch autoload {'on' if a['torch_autoload_enabled'] else 'off (TORCH_DEVICE_BACKEND_AUTOLOAD=0)'}"
        + f"; env asks for activation: {'yes' if a['env_requests_activation'] else 'no'}"
        + f"; at import torch: {a['status_at_import_torch'] or 'not called'}"
    )
    sw = facts["switches"]
    for name in ("compiler_collectives", "guard_collectives"):
        lines.append(f"{name.replace('_', ' ')}: {'ON' if sw[name]['on'] else 'off'} (from {sw[name]['source']})")
    lines.append("settings:")
    for env, v in sw["settings"].items():
        lines.append(f"  {env} = {v['value']!r} ({v['source']})")
    pg = facts["process_groups"]
    if pg["initialized"]:
        ours = ", ".join(f"{k}: {b}" for k, b in pg["ours"].items()) or "not created yet"
        lines.append(
            f"process group: rank {pg['rank']} of {pg['world_size']}, default backend "
            f"{pg['default_backend']}; ours: {ours}"
        )
        if pg.get("guard_transport"):
            lines.append(f"guard collective transport: {pg['guard_transport']}")
    else:
        lines.append("process group: not initialized (run under torchrun to check the groups)")
    found = problems(facts)
    lines.append("")
    if found:
        lines.append("PROBLEMS:")
        lines.extend(f"  - {p}" for p in found)
    else:
        lines.append("OK: nothing needed is missing.")
    return "\n".join(lines)


def run() -> int:
    """The `doctor` command: print the report; 0 when healthy, 1 otherwise."""
    import torch.distributed as dist

    under_launcher = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    created = False
    if under_launcher and dist.is_available() and not dist.is_initialized():
        dist.init_process_group("gloo")
        created = True
    try:
        facts = collect(create_groups=created)
        print(render(facts), flush=True)
        return 1 if problems(facts) else 0
    finally:
        if created:
            dist.destroy_process_group()
