"""A MODEL of compile once's cost per graph at scale: the transfer before issue 30 against the tree.

Nothing here runs at scale, and by default nothing is measured: every figure is an option with
a stated default, so the script runs in pure Python in well under a second (``--calibrate``
replaces the SHA-256 rate with one measured here, ~0.1 s of CPU). It counts, per graph, the
bytes through the busiest rank's link and in total, and the time the slowest rank spends on
the artifact's transfer and on the exchanges around it; not the compile, not the install.

Symbols: H hosts, L ranks per host (``--ranks-per-host``, 8), N = L*H ranks, S the artifact's
bytes (MB = 10^6 bytes), B the link speed (bytes/s; every rank its own full-duplex link of B,
one NIC per GPU; the issue counts "one rank's link"), hop the latency of one message between
hosts (``--hop-us``, 25), o the overhead of one send call from Python through gloo
(``--send-us``, 20), h the SHA-256 rate of one core (``--hash-gbs``, 1.5 GB/s; 1.41 measured
on this 2-core machine under load).

Who shares a key (``--keys``):
  device (default; GPU jobs): every rank's key holds its device (cuda:k), so ranks of one host
      never share; rank k of every host shares key k: G = L key groups of H ranks, one cache dir
      per host in each: D = H dirs, R = H-1 loaders with another dir than the source's.
  job: one key for all N ranks, and the L ranks of a host share one cache dir (the default
      TORCHINDUCTOR_CACHE_DIR): G = 1 group, D = H dirs, R = (H-1)*L loaders with another dir
      (the source's own host reads in place: ``transfer.SHARED``).
  The G groups have their sources on different ranks (``plan.decide`` rotates them), so they
  run side by side on different links; one graph costs one group's time.

Before issue 30 ("today" in the functions' and the JSON's names; the code up to commit 801e892,
read from it: ``transfer.Gloo.send``, since removed): the source posts one send of the whole
bundle to each of its R loaders at once; the sends share its one link; each loader checks every
file's digest once all its bytes are in (``artifact.split_verified``), then installs:
  busiest link  R*S (the source's, outbound)          total  G*R*S
  time          R*S/B + o + hop + S/h
  source RAM    R*S in flight (``send_bytes`` copied the bundle into a fresh buffer per send)

New (issue 30 items 1, 2 and 5, as ``agreements/once/transfer.py`` implements them since commit
0849bbd): one receiver per cache dir; a tree of fan-out F (``--fanout``, 2, the default of
COMPILER_COLLECTIVES_ONCE_FANOUT; 1 = a pipelined chain) across the D dirs; the bundle cut into
n = ceil(S/c) pieces of c bytes (``--chunk-mib``, 1, the default of
COMPILER_COLLECTIVES_ONCE_CHUNK_BYTES); a receiver checks each piece's digest (the digests come
from the source over the job's group) before it forwards it, while gloo's threads take the next
piece (every piece's receive is posted at once):
  d   depth: the least d with 1 + F + ... + F^d >= D (chain: D-1);  W = min(F, D-1) children
  t   c/B + o, one piece over one link;  p = max(W*t, c/h), the pipeline's period
  time          (n-1)*p + d*(W*t + hop + c/h)
  busiest link  W*S (an inner receiver: S in, W*S out)  total  G*(D-1)*S
  so with F = 2 and the link the bottleneck, about 2*S/B plus d = O(log2 H) piece steps; where
  one core's SHA-256 is slower than B/F (100 Gb/s), S/h bounds it instead (before paid S/h too).
  Not counted, as the code does it: after its last piece a receiver checks every file's digest
  again before it installs (``transfer.install``: S/h more), and its dir's other ranks check the
  files in place once it posted its install (S/h more for them).

Exchanges per graph (every rank; they do not depend on S):
  all-gathers (before issue 30, and at commit 0849bbd): three (keys, result, load report;
      ``exchange.gather``), each one round of fixed slots of 16 + 4096 bytes
      (COMPILER_COLLECTIVES_INLINE_SLOT_BYTES; an offer encodes to ~210 bytes, ``wire/once.py``)
      on gloo's ring all-gather, and every rank decodes all N payloads (``--decode-us``, 20 per
      payload; 72 measured here under load):
      bytes per rank (N-1)*slot each way; time AG = (N-1)*(hop + slot/B) + N*decode.
      (A result whose manifest and fingerprints pass 4,096 bytes takes a second round: not counted.)
  reduced keys (issue 30 item 3 as designed here; commit 2bb40f3 built item 3 otherwise, as one
      MIN all-reduce of a fixed record over the compile group, with the all-gather of offers at a
      generation's first graph and on a mismatch: not modeled), every key matching: the ranks of a
      host meet in shared memory (``--shm-us``, 5) as the guard's channel does; the host leaders
      reduce one fixed record up a tree of fan-out Fk (``--key-fanout``, 2) and broadcast the
      verdict down. The record: SHA-256 of the host's (local index, key, switches, graph) and,
      per local index, the best (holds, warmth, rank), 32 + 16*L bytes; dirs are elected on the
      host. With dk = depth(H, Fk):
      bytes per rank at most (Fk+1)*record each way; time 2*shm + 2*dk*(hop + o).
  reduced keys, a mismatch: the above, then the all-gather of every offer (AG).
  Item 3 changes the keys only: the result and the load report stay all-gathers (2*AG),
  which the last table column shows; reduced the same way they would cost about the keys' time each.

Run:  scripts/dev python scripts/once_scale_model.py [--hosts 1,8,128,1024,2048] [--sizes-mb 100]
      [--links-gbps 10,100] [--fanout 2] [--chunk-mib 1] [--hop-us 25] [--keys device|job] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from typing import Any

MB = 1_000_000
MIB = 1 << 20
SLOT_BYTES = 16 + 4096  # the all-gather's header and COMPILER_COLLECTIVES_INLINE_SLOT_BYTES' default
OFFER_BYTES = 208  # one offer as encode_once packs it (AOTAutograd key, boot-id dir identity, graph digest)
TARGET = (1024, 100.0, 10.0)  # issue 30's check: hosts, MB, Gb/s


@dataclasses.dataclass(frozen=True)
class Figures:
    """The model's fixed figures (all options of the script)."""

    ranks_per_host: int = 8
    hop_us: float = 25.0
    send_us: float = 20.0
    hash_gbs: float = 1.5
    decode_us: float = 20.0
    shm_us: float = 5.0
    fanout: int = 2
    key_fanout: int = 2
    chunk_mib: float = 1.0
    keys: str = "device"  # or "job"


def depth(dirs: int, fanout: int) -> int:
    """Levels below the source of a tree of ``fanout`` over ``dirs`` dirs (the source's included)."""
    if dirs <= 1:
        return 0
    if fanout == 1:
        return dirs - 1
    d, reach, level = 0, 1, 1
    while reach < dirs:
        d += 1
        level *= fanout
        reach += level
    return d


def groups(hosts: int, f: Figures) -> tuple[int, int, int]:
    """(key groups G, dirs per group D, loaders per group with another dir than the source's R)."""
    if f.keys == "device":
        return f.ranks_per_host, hosts, hosts - 1
    return 1, hosts, (hosts - 1) * f.ranks_per_host


def today(hosts: int, size: float, link: float, f: Figures) -> dict[str, float]:
    """The transfer of one graph before issue 30: ``size`` bytes, ``link`` bytes/s. Times in seconds."""
    g, _, r = groups(hosts, f)
    if r == 0:
        return {"busiest_bytes": 0.0, "total_bytes": 0.0, "time_s": 0.0, "source_ram_bytes": 0.0}
    return {
        "busiest_bytes": r * size,
        "total_bytes": g * r * size,
        "time_s": r * size / link + f.send_us * 1e-6 + f.hop_us * 1e-6 + size / (f.hash_gbs * 1e9),
        "source_ram_bytes": r * size,
    }


def new(hosts: int, size: float, link: float, f: Figures) -> dict[str, float]:
    """The tree's transfer of one graph (``transfer.py``): one receiver per dir, pieces, fan-out ``f.fanout``."""
    g, dirs, _ = groups(hosts, f)
    d = depth(dirs, f.fanout)
    if dirs <= 1:
        return {"busiest_bytes": 0.0, "total_bytes": 0.0, "time_s": 0.0, "depth": 0, "chunks": 0}
    wide = min(f.fanout, dirs - 1)  # the most children one receiver has
    c = min(size, f.chunk_mib * MIB)
    n = math.ceil(size / c)
    t = c / link + f.send_us * 1e-6
    check = c / (f.hash_gbs * 1e9)
    period = max(wide * t, check)
    return {
        "busiest_bytes": wide * size,
        "total_bytes": g * (dirs - 1) * size,
        "time_s": (n - 1) * period + d * (wide * t + f.hop_us * 1e-6 + check),
        "depth": d,
        "chunks": n,
    }


def all_gather(hosts: int, link: float, f: Figures) -> dict[str, float]:
    """The key exchange before issue 30 (and each of the two others): gloo's ring all-gather of fixed slots."""
    n = f.ranks_per_host * hosts
    return {
        "bytes_per_rank": (n - 1) * SLOT_BYTES,
        "payload_bytes_per_rank": (n - 1) * OFFER_BYTES,
        "time_s": (n - 1) * (f.hop_us * 1e-6 + SLOT_BYTES / link) + n * f.decode_us * 1e-6,
    }


def record_bytes(f: Figures) -> int:
    return 32 + 16 * f.ranks_per_host


def new_keys(hosts: int, link: float, f: Figures, match: bool = True) -> dict[str, float]:
    """The reduced key exchange (issue 30 item 3 as designed here, not as built): a reduce of one
    fixed record per host up a tree, the verdict down; on a mismatch, the all-gather after it."""
    dk = depth(hosts, f.key_fanout)
    rec = record_bytes(f)
    wide = min(f.key_fanout, max(hosts - 1, 0))
    out = {
        "bytes_per_rank": (wide + 1) * rec if hosts > 1 else 0,
        "time_s": 2 * f.shm_us * 1e-6 + 2 * dk * (f.hop_us * 1e-6 + f.send_us * 1e-6 + rec / link),
        "rounds": 2 * dk,
    }
    if not match:
        ag = all_gather(hosts, link, f)
        out["bytes_per_rank"] += ag["bytes_per_rank"]
        out["time_s"] += ag["time_s"]
    return out


def row(hosts: int, size_mb: float, link_gbps: float, f: Figures) -> dict[str, Any]:
    size, link = size_mb * MB, link_gbps * 1e9 / 8
    a, b = today(hosts, size, link, f), new(hosts, size, link, f)
    ag = all_gather(hosts, link, f)
    keys, keys_bad = new_keys(hosts, link, f), new_keys(hosts, link, f, match=False)
    floor = size / link
    return {
        "hosts": hosts,
        "ranks": hosts * f.ranks_per_host,
        "size_mb": size_mb,
        "link_gbps": link_gbps,
        "size_over_bw_s": floor,
        "today": a,
        "new": b,
        # None: nothing travels (one host: no two ranks share a key on GPU jobs; one dir per host otherwise)
        "today_over_floor": a["time_s"] / floor if a["time_s"] else None,
        "new_over_floor": b["time_s"] / floor if b["time_s"] else None,
        "speedup": a["time_s"] / b["time_s"] if b["time_s"] else None,
        "exchanges": {
            "today_keys": ag,
            "today_three_s": 3 * ag["time_s"],
            "new_keys_match": keys,
            "new_keys_mismatch": keys_bad,
            "new_result_and_report_s": 2 * ag["time_s"],
        },
        "today_graph_s": a["time_s"] + 3 * ag["time_s"],
        "new_graph_s": b["time_s"] + keys["time_s"] + 2 * ag["time_s"],  # with the reduced keys
        "new_graph_keys_gathered_s": b["time_s"] + 3 * ag["time_s"],  # the tree, the keys all-gathered
    }


def _t(s: float) -> str:
    if s == 0:
        return "0"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


def _b(n: float) -> str:
    if n == 0:
        return "0"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if n < 1000 * scale else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"


def _x(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:.2f}x" if v < 10 else f"{v:.0f}x"


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def calibrate_hash() -> float:
    """SHA-256 of one core, GB/s: the best of three 32 MiB digests (~0.1 s of CPU)."""
    data = os.urandom(32 * MIB)
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        hashlib.sha256(data).digest()
        best = min(best, time.perf_counter() - start)
    return len(data) / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hosts", default="1,2,8,128,1024,2048", help="host counts, comma-separated")
    parser.add_argument("--sizes-mb", default="1,100,200", help="artifact sizes in MB (10^6 bytes)")
    parser.add_argument("--links-gbps", default="10,100", help="link speeds in Gb/s")
    parser.add_argument("--ranks-per-host", type=int, default=Figures.ranks_per_host)
    parser.add_argument("--hop-us", type=float, default=Figures.hop_us, help="one message between hosts")
    parser.add_argument("--send-us", type=float, default=Figures.send_us, help="overhead of one send call (piece)")
    parser.add_argument("--hash-gbs", type=float, default=Figures.hash_gbs, help="SHA-256 of one core, GB/s")
    parser.add_argument("--decode-us", type=float, default=Figures.decode_us, help="decoding one rank's payload")
    parser.add_argument("--shm-us", type=float, default=Figures.shm_us, help="the host's shared-memory step")
    parser.add_argument("--fanout", type=int, default=Figures.fanout, help="the artifact tree's (1: a chain)")
    parser.add_argument("--key-fanout", type=int, default=Figures.key_fanout, help="the key reduce's tree")
    parser.add_argument("--chunk-mib", type=float, default=Figures.chunk_mib)
    parser.add_argument("--keys", choices=("device", "job"), default=Figures.keys)
    parser.add_argument("--calibrate", action="store_true", help="measure the SHA-256 rate here (~0.1 s)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.fanout < 1 or args.key_fanout < 2 or args.ranks_per_host < 1 or args.chunk_mib <= 0:
        parser.error("--fanout >= 1, --key-fanout >= 2, --ranks-per-host >= 1, --chunk-mib > 0")
    hash_gbs = calibrate_hash() if args.calibrate else args.hash_gbs
    f = Figures(
        args.ranks_per_host,
        args.hop_us,
        args.send_us,
        hash_gbs,
        args.decode_us,
        args.shm_us,
        args.fanout,
        args.key_fanout,
        args.chunk_mib,
        args.keys,
    )
    hosts = [int(h) for h in _floats(args.hosts)]
    rows = [row(h, s, b, f) for b in _floats(args.links_gbps) for s in _floats(args.sizes_mb) for h in hosts]
    target = row(*TARGET, f)
    if args.json:
        json.dump({"figures": dataclasses.asdict(f), "rows": rows, "target": target}, sys.stdout, indent=1)
        print()
        return
    print("once_scale_model (A MODEL, not a measurement at scale)")
    print(
        f"figures: {f.ranks_per_host} ranks per host, keys per {f.keys}, hop {f.hop_us:g} µs, send call "
        f"{f.send_us:g} µs, SHA-256 {f.hash_gbs:.2f} GB/s{' (measured here)' if args.calibrate else ''}, "
        f"decode {f.decode_us:g} µs a payload, shm {f.shm_us:g} µs; new: fan-out {f.fanout}, "
        f"{f.chunk_mib:g} MiB pieces, key tree fan-out {f.key_fanout}"
    )
    print(
        "before: the transfer up to commit 801e892 (one copy per loader from the source); new: the tree "
        "of agreements/once/transfer.py; reduced keys: issue 30 item 3 as designed here (commit 2bb40f3 "
        "built it as one MIN all-reduce: not modeled)\n"
    )
    print("Artifact transfer per graph (busiest link: the busiest rank's; total: every link's bytes):\n")
    print(
        "| hosts | ranks | size | link | S/B | before: busiest link | before: total | before: time | before ÷ S/B "
        "| new: busiest link | new: total | new: depth | new: time | new ÷ S/B | before ÷ new |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, b = r["today"], r["new"]
        print(
            f"| {r['hosts']} | {r['ranks']} | {r['size_mb']:g} MB | {r['link_gbps']:g} Gb/s "
            f"| {_t(r['size_over_bw_s'])} "
            f"| {_b(a['busiest_bytes'])} | {_b(a['total_bytes'])} | {_t(a['time_s'])} | {_x(r['today_over_floor'])} "
            f"| {_b(b['busiest_bytes'])} | {_b(b['total_bytes'])} | {b['depth']} | {_t(b['time_s'])} "
            f"| {_x(r['new_over_floor'])} | {_x(r['speedup'])} |"
        )
    print("\nExchanges per graph (they do not depend on the artifact's size):\n")
    print(
        "| hosts | ranks | link | keys all-gather, bytes per rank | keys all-gather | 3 all-gathers "
        "| reduced keys (as designed; match): bytes per rank | reduced keys (match) | reduced keys (mismatch) "
        "| result + load report (still all-gathers) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    seen = set()
    for r in rows:
        if (r["hosts"], r["link_gbps"]) in seen:
            continue
        seen.add((r["hosts"], r["link_gbps"]))
        e = r["exchanges"]
        print(
            f"| {r['hosts']} | {r['ranks']} | {r['link_gbps']:g} Gb/s | {_b(e['today_keys']['bytes_per_rank'])} "
            f"| {_t(e['today_keys']['time_s'])} | {_t(e['today_three_s'])} "
            f"| {_b(e['new_keys_match']['bytes_per_rank'])} | {_t(e['new_keys_match']['time_s'])} "
            f"| {_t(e['new_keys_mismatch']['time_s'])} | {_t(e['new_result_and_report_s'])} |"
        )
    t = target
    print(
        f"\nTarget (issue 30): {t['hosts']:,} hosts, {t['size_mb']:g} MB, {t['link_gbps']:g} Gb/s: "
        f"S/B = {_t(t['size_over_bw_s'])}; new {_t(t['new']['time_s'])} = {_x(t['new_over_floor'])} S/B "
        f"(depth {t['new']['depth']}, {t['new']['chunks']} pieces; target ~2x plus log-depth latency: "
        f"{'met' if (t['new_over_floor'] or 0) <= 2.5 else 'NOT met'}); before {_t(t['today']['time_s'])} = "
        f"{_x(t['today_over_floor'])} S/B ({t['hosts'] - 1:,} copies on one link, then the check), with "
        f"{_b(t['today']['source_ram_bytes'])} of send buffers in flight on the source; "
        f"{_x(t['speedup'])} faster. Per graph with the exchanges: before {_t(t['today_graph_s'])}, "
        f"new {_t(t['new_graph_keys_gathered_s'])} with the keys all-gathered, "
        f"{_t(t['new_graph_s'])} with the reduced keys (of which "
        f"{_t(t['exchanges']['new_result_and_report_s'])} the result and load-report all-gathers)."
    )


if __name__ == "__main__":
    main()
