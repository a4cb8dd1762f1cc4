"""Switch a rank between our implementation and torch 2.13's own, for side-by-side benchmarks.

Torch's own compiler collective cannot run on a gloo/CPU group as shipped: it
asserts a single device type on its group and enters a device context for
``rank % torch.accelerator.device_count()`` (0 on CPU). To measure it anyway we
give it a CPU-only gloo group and skip the device context; everything else,
including its ``all_gather_object`` (pickle), runs as torch wrote it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist


class _NoDevice:
    @staticmethod
    def device(index: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class ImplementationSwitch:
    """Create on every rank at the same point (it creates a process group)."""

    def __init__(self) -> None:
        import compiler_collectives  # noqa: F401  (installs ours)

        self._cpu_pg = dist.new_group(backend="cpu:gloo")
        self.current = "ours"

    def use(self, which: str) -> None:
        """which: 'ours' or 'torch'."""
        import torch._dynamo.convert_frame as convert_frame
        import torch._dynamo.output_graph as output_graph

        import compiler_collectives as cc

        if which == self.current:
            return
        if which == "torch":
            cc.uninstall()
            pg = self._cpu_pg
            convert_frame.get_compile_pg = lambda: pg if torch._dynamo.config.enable_compiler_collectives else None
            self._saved = (output_graph.get_interface_for_device, torch.accelerator.device_count)
            output_graph.get_interface_for_device = lambda _device: _NoDevice()
            torch.accelerator.device_count = lambda: 1
        elif which == "ours":
            from compiler_collectives import dynamo

            output_graph.get_interface_for_device, torch.accelerator.device_count = self._saved
            convert_frame.get_compile_pg = dynamo.torch_original("get_compile_pg")
            cc.install()
        else:
            raise ValueError(which)
        self.current = which


def torch_pickle_size(local_state: Any) -> int:
    """Bytes torch's all_gather_object would pickle for the same LocalState."""
    import pickle

    from torch._dynamo.symbolic_convert import LocalState as TorchLocalState

    from compiler_collectives.dynamo import entry_to_torch

    theirs = TorchLocalState(automatic_dynamic={k: entry_to_torch(v) for k, v in local_state.automatic_dynamic.items()})
    return len(pickle.dumps(theirs))
