"""NCCL as the default group, with our gloo groups beside it, on a GPU machine.

Run it as a user would, by torchrun and env vars only, on a machine with one
CUDA GPU (NCCL refuses two ranks on one GPU, so the world is one rank)::

    TORCH_COMPILER_COLLECTIVES=1 COMPILER_COLLECTIVES_GUARDS=1 \\
        torchrun --nproc-per-node 1 scripts/gpu_check.py [--json out.json]

It checks, and prints one line per check (PASS/FAIL) and a JSON summary:

* the package was loaded by torch's backend autoload and both switches are on;
* DDP over NCCL, compiled by inductor on CUDA, with a sequence length that
  changes between steps: same gradients as eager DDP, the compiler and guard
  collectives ran, and our groups are gloo groups beside the NCCL default;
* a functional all_reduce on the NCCL default group inside an inductor graph
  (at world size 1 the program audit has no peer to compare with, and skips);
* the guard collective does not wait behind the CUDA stream: a compiled call
  made while ~0.5 s of GPU work is queued returns in a fraction of that;
* nor behind the user's collectives: a compiled call made while an NCCL
  all_reduce is in flight on the default group returns before it is waited on.

Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

RESULTS: list[dict] = []


def check(name: str, ok: bool, **detail: object) -> None:
    RESULTS.append({"check": name, "ok": bool(ok), **detail})
    print(f"{'PASS' if ok else 'FAIL'} {name} {json.dumps(detail, default=str)}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Block(torch.nn.Module):
    """A small pre-norm transformer block with attention: per-step sequence lengths."""

    def __init__(self, dim: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


def ddp_inductor(device: torch.device) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import compiler_collectives as cc

    def make() -> DDP:
        torch.manual_seed(0)
        return DDP(Block().to(device), device_ids=[device.index] if device.type == "cuda" else None)

    compiled_model, eager_model = make(), make()
    compiled = torch.compile(compiled_model, backend="inductor")
    same = []
    for step, seq in enumerate((16, 24, 40, 24)):
        g = torch.Generator(device=device).manual_seed(step)
        x = torch.randn(4, seq, 256, device=device, generator=g)
        for m in (compiled_model, eager_model):
            m.zero_grad()
        compiled(x).square().mean().backward()
        eager_model(x).square().mean().backward()
        same.append(
            all(
                torch.allclose(a.grad, b.grad, atol=2e-3, rtol=2e-3)
                for a, b in zip(compiled_model.parameters(), eager_model.parameters())
            )
        )
    sync(device)
    s = cc.stats()
    check("ddp+inductor on NCCL: same gradients as eager DDP at every step", all(same), steps=same)
    check(
        "ddp+inductor on NCCL: compiler and guard collectives ran",
        s["compiler_collectives"] >= 1 and s["guard_collectives"] >= 1,
        compiler_collectives=s["compiler_collectives"],
        guard_collectives=s["guard_collectives"],
        guard_transport=s["guard_transport"],
        audit_exchanges=s["audit_exchanges"],
        audit_divergences=s["audit_divergences"],
    )
    check(
        "the default group is NCCL",
        dist.get_backend() == ("gloo" if device.type == "cpu" else "nccl"),
        backend=dist.get_backend(),
    )


def functional_collective_in_inductor(device: torch.device) -> None:
    import torch.distributed._functional_collectives as funcol

    import compiler_collectives as cc

    before = cc.stats()["audit_exchanges"]

    def f(x: torch.Tensor) -> torch.Tensor:
        y = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
        return y.relu() + 1

    cf = torch.compile(f, backend="inductor")
    x = torch.randn(8, 32, device=device)
    out = cf(x)
    out2 = cf(torch.randn(12, 32, device=device))
    sync(device)
    ok = torch.allclose(out, f(x)) and out2.shape == (12, 32)
    s = cc.stats()
    check(
        "functional all_reduce on the NCCL group inside an inductor graph",
        ok,
        audit_exchanges=s["audit_exchanges"] - before,
        audit_divergences=s["audit_divergences"],
    )


def not_behind_the_cuda_stream(device: torch.device) -> None:
    import compiler_collectives as cc

    cf = torch.compile(lambda x: x * 3 + 1, backend="inductor")
    x = torch.randn(1024, device=device)
    cf(x)
    a = torch.randn(8192, 8192, device=device)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(20):
        a = a @ a
        a = a / a.norm()
    sync(device)
    gpu_s = time.perf_counter() - t0
    guards_before = cc.stats()["guard_collectives"]
    for _ in range(20):  # queue the same GPU work again, then make a compiled call behind it
        a = a @ a
        a = a / a.norm()
    t1 = time.perf_counter()
    cf(x)
    call_s = time.perf_counter() - t1
    sync(device)
    ran = cc.stats()["guard_collectives"] - guards_before
    check(
        "a compiled call's guard collective does not wait for queued GPU work",
        ran == 1 and call_s < gpu_s / 10,
        queued_gpu_work_s=round(gpu_s, 4),
        compiled_call_s=round(call_s, 6),
        guard_collectives=ran,
    )


def not_behind_user_collectives(device: torch.device) -> None:
    import compiler_collectives as cc

    cf = torch.compile(lambda x: x - 1, backend="inductor")
    x = torch.randn(1024, device=device)
    cf(x)
    big = torch.ones(64 << 20, device=device)
    guards_before = cc.stats()["guard_collectives"]
    work = dist.all_reduce(big, async_op=True)
    t0 = time.perf_counter()
    cf(x)
    call_s = time.perf_counter() - t0
    work.wait()
    sync(device)
    ran = cc.stats()["guard_collectives"] - guards_before
    check(
        "a compiled call's guard collective does not wait for an NCCL all_reduce in flight",
        ran == 1 and call_s < 0.05 and bool(big[0].item() == 1.0),
        compiled_call_s=round(call_s, 6),
    )


def our_groups_are_gloo() -> None:
    from compiler_collectives.transport import groups

    backends = {name: str(dist.get_backend(pg)) for name, pg in groups.existing().items()}
    check(
        "our groups are gloo groups beside the NCCL default group",
        bool(backends) and all(b == "gloo" for b in backends.values()),
        groups=backends,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="rehearse the script on a machine without a GPU: gloo and CPU tensors (the CUDA-stream check is skipped)",
    )
    args = parser.parse_args()
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    check(
        "autoload: compiler_collectives was loaded with torch, by env vars only",
        "compiler_collectives" in sys.modules and bool(torch._dynamo.config.enable_compiler_collectives),
        enable_compiler_collectives=torch._dynamo.config.enable_compiler_collectives,
    )
    import compiler_collectives as cc

    check("guard collectives switched on by COMPILER_COLLECTIVES_GUARDS", cc.guards_enabled())
    ddp_inductor(device)
    functional_collective_in_inductor(device)
    if device.type == "cuda":
        not_behind_the_cuda_stream(device)
    not_behind_user_collectives(device)
    our_groups_are_gloo()
    cuda = device.type == "cuda"
    summary = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "world": dist.get_world_size(),
        "stats": cc.stats(),
        "checks": RESULTS,
    }
    print(json.dumps(summary, default=str, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, default=str, indent=1)
    dist.destroy_process_group()
    return 0 if all(r["ok"] for r in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
