"""Compile once's build fingerprint: what a host builds kernels for and with, which its cache key
does not say.

The FX graph cache's key holds the graph, torch and the device, but not the CPU a kernel was built
for nor the compiler that built it: inductor builds C++ kernels with ``-march=native``, so a
``.so`` from a host with another CPU (wider vectors, AMX, other flags) or another toolchain may not
run here, or run with other numerics. The ranks settle their fingerprints with their keys: ranks
whose fingerprints differ never share an artifact, each build compiles its own (``plan.decide``
groups ranks by key and fingerprint), and the graph's record says why.

The fingerprint: the CPU's vector capability as ATen dispatches it
(``torch.backends.cpu.get_cpu_capability``), a digest of the CPU's feature flags (what
``-march=native`` resolves from: ``/proc/cpuinfo`` on Linux, the processor's name elsewhere),
the C++ compiler and a digest of its version text (through the seam, ``Cache.compiler``), and
torch's version and commit. Computed once per process: none of it changes while it runs.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import re

import torch

MAX_CHARS = 256
"""The longest fingerprint (``wire.once`` bounds it there too)."""


def fingerprint(compiler: str) -> str:
    """This process's build fingerprint; ``compiler``: the C++ compiler and its version, as the
    seam reads them ("" where the seam cannot: the fingerprint then says so)."""
    return _fingerprint(compiler)


@functools.cache
def _fingerprint(compiler: str) -> str:
    capability = torch.backends.cpu.get_cpu_capability().lower()
    torch_build = f"torch {torch.__version__} {(torch.version.git_version or '')[:12]}".strip()
    text = f"{capability} cpu:{cpu_flags_digest()} {compiler or 'compiler unknown'} {torch_build}"
    return text[:MAX_CHARS]


@functools.cache
def cpu_flags_digest() -> str:
    """A short digest of this CPU's feature flags (its model name where the flags cannot be read)."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if re.match(r"(flags|Features)\s*:", line):
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
                    break
    except OSError:
        pass
    return hashlib.blake2b((flags or platform.processor() or platform.machine()).encode(), digest_size=4).hexdigest()


def compiler_text(name: str, version_text: str) -> str:
    """The compiler as the fingerprint names it: its name, the version it reports, and a digest of
    its whole version text (its configuration, its target)."""
    found = re.search(r"\b(?:gcc|clang) version (\S+)", version_text) or re.search(
        r"\b(\d+\.\d+(?:\.\d+)?)\b", version_text
    )
    digest = hashlib.blake2b(version_text.encode(), digest_size=4).hexdigest()
    return f"{name} {found.group(1) if found else '?'} ({digest})"
