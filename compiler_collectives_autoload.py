"""Zero-code activation of compiler_collectives, called by torch during ``import torch``.

Registered as a ``torch.backends`` entry point: torch calls ``load()`` near the
end of its own import unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``. This module
is deliberately tiny and lives outside the ``compiler_collectives`` package,
so that with none of our environment variables set it imports nothing but
``os`` and costs nothing measurable. With one set, it imports the package,
which installs our implementation into ``torch._dynamo``.

A typo in one of our variables (a value that does not parse, or a
``COMPILER_COLLECTIVES_*`` name that is not ours) fails ``import torch`` on
purpose: that rank would otherwise run with a different setting, or with
torch's own compiler collectives, while its peers run ours, and they would
wait out the full timeout blaming it. Torch wraps what an entry point raises in
``RuntimeError("Failed to load the backend extension: compiler_collectives ...")``
chained to ours, so the traceback shows our ``ConfigError`` (variable, value,
accepted values) first; we also log it as one ERROR line. Any other failure
(a torch without our seams) must not break ``import torch``: it is logged as
one warning naming the cause, and torch is left as it was.
"""

import os
from collections.abc import Mapping

# Set to a value other than an "off" one, torch's switch or any of ours except
# those below activates the package, which then checks every one of our
# variables: so a misspelt name or a bad value is caught, not ignored.
_TORCH_SWITCH = "TORCH_COMPILER_COLLECTIVES"
_PREFIX = "COMPILER_COLLECTIVES_"
_NOT_TRIGGERS = ("COMPILER_COLLECTIVES_AUTOLOAD", "COMPILER_COLLECTIVES_LOG_LEVEL", "COMPILER_COLLECTIVES_VENV_CACHE")
_OFF = ("", "0", "false", "no", "off")

# What happened at import torch, for `doctor`: None (not called), "inactive",
# "active" or "failed: <cause>".
status = None


def wanted(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    if environ.get("COMPILER_COLLECTIVES_AUTOLOAD", "1").strip().lower() in _OFF:
        return False
    return any(
        (name == _TORCH_SWITCH or (name.startswith(_PREFIX) and name not in _NOT_TRIGGERS))
        and value.strip().lower() not in _OFF
        for name, value in environ.items()
    )


def load() -> None:
    global status
    if not wanted():
        status = "inactive"
        return
    try:
        import compiler_collectives  # noqa: F401  (installs itself)

        status = "active"
    except BaseException as e:
        status = f"failed: {type(e).__name__}: {e}"
        import logging

        # By name: the failed import took compiler_collectives.errors out of sys.modules.
        if (type(e).__module__, type(e).__name__) == ("compiler_collectives.errors", "ConfigError"):
            logging.getLogger("compiler_collectives.autoload").error(
                "compiler_collectives: %s. Stopping this process: with this variable wrong it would "
                "not run the compile and guard decisions its peers run. Fix the variable (or unset "
                "every COMPILER_COLLECTIVES_* variable and TORCH_COMPILER_COLLECTIVES to run without "
                "compiler collectives).",
                e,
            )
            raise
        try:
            from compiler_collectives import dynamo

            dynamo.uninstall()
        except BaseException:  # noqa: BLE001
            pass
        logging.getLogger("compiler_collectives.autoload").warning(
            "compiler_collectives autoload failed, torch continues without it (%s: %s). "
            "Set COMPILER_COLLECTIVES_AUTOLOAD=0 to silence this, or run "
            "`python -m compiler_collectives doctor`.",
            type(e).__name__,
            e,
        )
