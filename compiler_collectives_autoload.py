"""Zero-code activation of compiler_collectives, called by torch during ``import torch``.

Registered as a ``torch.backends`` entry point: torch calls ``load()`` near the
end of its own import unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``. This module
is deliberately tiny and lives outside the ``compiler_collectives`` package,
so that with none of our environment variables set it imports nothing but
``os`` and costs nothing measurable. With one set, it imports the package,
which installs our implementation into ``torch._dynamo``.

A failure here must never break ``import torch``: it is logged as one warning
naming the cause, and torch is left as it was.
"""

import os

# Any of these, set to a value that turns something on, activates the package.
_TRIGGERS = (
    "TORCH_COMPILER_COLLECTIVES",
    "COMPILER_COLLECTIVES_GUARDS",
    "COMPILER_COLLECTIVES_TIMING",
    "COMPILER_COLLECTIVES_TRACE_DIR",
)
_OFF = ("", "0", "false", "no", "off")

# What happened at import torch, for `doctor`: None (not called), "inactive",
# "active" or "failed: <cause>".
status = None


def wanted(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    if environ.get("COMPILER_COLLECTIVES_AUTOLOAD", "1").strip().lower() in _OFF:
        return False
    return any(environ.get(name, "").strip().lower() not in _OFF for name in _TRIGGERS)


def load() -> None:
    global status
    if not wanted():
        status = "inactive"
        return
    try:
        import compiler_collectives  # noqa: F401  (installs itself)

        status = "active"
    except BaseException as e:  # noqa: BLE001 - never break import torch
        status = f"failed: {type(e).__name__}: {e}"
        try:
            from compiler_collectives import dynamo_seams

            dynamo_seams.uninstall()
        except BaseException:  # noqa: BLE001
            pass
        import logging

        logging.getLogger("compiler_collectives.autoload").warning(
            "compiler_collectives autoload failed, torch continues without it (%s: %s). "
            "Set COMPILER_COLLECTIVES_AUTOLOAD=0 to silence this, or run "
            "`python -m compiler_collectives doctor`.",
            type(e).__name__, e,
        )
