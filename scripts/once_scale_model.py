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
  again before it installs (``loading.install``: S/h more), and its dir's other ranks check the
  files in place once it posted its install (S/h more for them).

Exchanges per graph (every rank; they do not depend on S), with R the result's encoded bytes
(``--result-kib``, 8: a manifest and a digest per 1 MiB piece; a 100 MB artifact has 96) and
S_src the sources of one graph (G: one per key group):
  before issue 37 (the code up to its item 3, "before37" in the JSON): the keys one gloo ring
      MIN all-reduce of 5 int64 over the N ranks, 2(N-1)*hop; GPU jobs (``--keys device``)
      on more than one host never match it (the digest held the device's key) and all-gather
      every offer after it; the result one all-gather of fixed slots of 16 + 4096 bytes
      (COMPILER_COLLECTIVES_INLINE_SLOT_BYTES) and, where R passes 4,096 bytes, a second round of
      R-byte slots; the load report one all-gather; every all-gather decodes N payloads
      (``--decode-us``, 20):
        AG(slot) = (N-1)*(hop + slot/B) + N*decode
  as built (issue 37 item 3; ``transport/hosttree.py``), with L ranks per host. Every message
      of the tree starts with a record of 10 + 8 + 4L int64 (rec: the operation, the stamp, the
      entries that follow; the MIN's values), one width for every operation:
      tree MIN (the keys; the load report's flag): each rank sends its record to its host's
          leader over gloo's loopback (``--local-hop-us``, 30), the leaders MIN it by recursive
          doubling (ceil(log2 H) rounds, two more when H is not a power of two; each a send and a
          receive), the leader sends it back; the exchange runs on a helper thread
          (``--thread-us``, 100):
            Tmin = 2*(local + (L-1)*o) + rounds*(hop + 2*o + rec/B) + thread
          bytes per rank: rec each way (a leader: (L-1)*rec each way plus rec per round);
      tree gather of k entries of e bytes (the results: k = S_src, e = R; before issue 43, a
          load report's details, k = the ranks that missed or refused, e = ``LOADED_BYTES``, and
          a generation's first graph, k = N offers, e = ``OFFER_BYTES``): the same path, a record
          and then the entries (16 bytes of header each) per message; the leaders' rounds carry the set
          X = k*(16 + e) once across (twice where H is not a power of two: a leader past P
          takes the whole set back), each leader sends X to each of its L-1 ranks over the
          loopback (``--local-gbs``, 3), every rank decodes the k entries:
            Tg = 2*(local + (L-1)*2*o) + (L-1)*X/Bl + rounds*(hop + 4*o + rec/B)
                 + X*(1 or 2)/B + k*decode + thread
          bytes per rank: rec up, rec + X down;
      tree table of k rows of C columns with D distinct values of V bytes in all (issue 43;
          ``HostTree.gather_table``: a generation's first graph, k = N offers of
          C = ``OFFER_COLUMNS``, D = 2 keys and graphs per device index (one per job with
          ``--keys job``), a dir per host and one value for each other column; a miss round,
          k = the ranks that missed or refused, C = ``LOADED_COLUMNS``, D = 3): the gather's
          path, with the table X = 8(2 + C + D) + 4k(1 + C) + V instead of the entries; each
          leader folds every other row in once (``--fold-us`` a row, 7 more a row for its own
          host's, which come one by one), and every rank reads the table: k rows
          (``--row-us``: unpacked, sorted, its body built) and D values (``--value-us``: decoded
          and checked once):
            Tt = Tg(X) without k*decode + k*fold + k*row + D*value
      per graph, keys matching and every rank loading: 2*Tmin + Tg(S_src, R); a miss round (a
      graph where ranks missed or refused) adds Tt(their outcomes); the model takes the worst,
      every loader (N - S_src ranks); the others send a flag only); a generation's first graph
      adds Tt(N offers) and one all-gather of host keys (8 bytes per rank: the tree is built
      from it). Before issue 43 ("before43" in the JSON) they were Tg(k, LOADED_BYTES) and
      Tg(N, OFFER_BYTES): every rank decoded every contributor's payload. ``--calibrate``
      measures row, value and fold on the code itself (``calibrate_tables``; ~2 s).
  Keys per device index settle in the tree MIN: torch's own keys hold the device index (the FX
  graph cache's pickler keys tensors with ``device_id_agnostic=False``) and so never match across
  a host; the record compares each index's key across hosts instead (``once.keys``).

Store requests (the c10d store: one server, rank 0's under torchrun; every figure per second at
that store):
  heartbeat: every rank writes its record and reads the failure count every
      COMPILER_COLLECTIVES_HEARTBEAT_S (``--heartbeat-s``, 1): 2N/hb; while a rank waits for
      sources, the read of the failure count is a ``multi_get`` that reads their records too
      (``store.board.SideChannel``): still 2 a beat;
  compile wait: while a graph compiles, every rank but the sources waits for every source's
      post (``compile_wait.wait_for_posts``). As built (issue 43) it blocks and asks nothing
      while it lasts: one blocking ``wait`` for all the sources' posts and one ``multi_get`` of
      them (``store.mailbox.NoticeWait``), on a store connection of its own made once per
      generation with its compile group; the sources' records come with the waiting rank's
      heartbeat, /proc and the gloo connection cost the store nothing, failure reports come
      through the heartbeat. Steady state: 0; per graph 2 (N - S_src) + S_src, whatever the
      compile's length.
      Issue 37 (item 2), before: a connection per waiting rank and graph, per source a ``wait``
      and a ``get``, a first read of its liveness (its failure key, whether it has a record, the
      record), then one ``multi_get`` of all their records each time the last read made them look
      silent: once per stale_after = 2.5 hb + 0.5 s (3 s) while they beat. Steady state:
      (N - S_src) / stale_after; per graph (N - S_src) * (1 + 5 S_src + C / stale_after) + S_src
      over a compile of C seconds (``--compile-s``, 30).
      Before that, it polled: per pending source and look, one check of the post and three reads
      of the source's liveness, looks backing off from 5 ms to every 0.2 s: (N - S_src) * S_src *
      4 / 0.2 s, and about 7 + (C - 0.3)/0.2 looks per pending source over a compile.
  Posts: one per source and one per receiver with readers per graph (a set each).

Run:  scripts/dev python scripts/once_scale_model.py [--hosts 1,8,128,1024,2048] [--sizes-mb 100]
      [--links-gbps 10,100] [--fanout 2] [--chunk-mib 1] [--hop-us 25] [--keys device|job]
      [--result-kib 8] [--compile-s 30] [--json]
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
LOADED_BYTES = 83  # one load report's details as encode_once packs them at 8,192 ranks (a miss, its reason)
OFFER_COLUMNS = 10  # a row of an offer (wire.once.encode_row): its head, then its 9 fields
LOADED_COLUMNS = 3  # a row of a load outcome: its head, the outcome, why
# The packed bytes of a table's distinct values: an AOTAutograd key, a graph digest, a cache dir's
# identity (boot id, device, inode), a row's head at 8,192 ranks, the one value of each of an
# offer's five other columns (no why, not held, no switches, 2**30, cold), a load's outcome and reason.
KEY_BYTES, GRAPH_BYTES, DIR_BYTES, ROW_HEAD_BYTES, OFFER_OTHER_BYTES = 54, 66, 51, 24, 9
# A build fingerprint (agreements/once/build.py), one per job where every host is built alike.
BUILD = "avx2 cpu:c0b5898d g++ 12.2.0 (36591aa9) torch 2.15.0 0123456789ab"
BUILD_BYTES = 2 + len(BUILD)
OUTCOME_HEAD_BYTES, OUTCOME_BYTES, REASON_BYTES = 26, 5, 48  # "miss"; "the entry's guards fail ... hints"
ENTRY_HEAD = 16  # per entry of a tree gather: its rank and length (transport/hosttree.py)
TREE_HEAD = 10  # int64s before a tree record's values (hosttree.HEAD)
TARGET = (1024, 100.0, 10.0)  # issue 30's check: hosts, MB, Gb/s


@dataclasses.dataclass(frozen=True)
class Figures:
    """The model's fixed figures (all options of the script)."""

    ranks_per_host: int = 8
    hop_us: float = 25.0
    send_us: float = 20.0
    hash_gbs: float = 1.5
    decode_us: float = 20.0
    row_us: float = 0.8  # a table's row on a receiving rank: unpacked, sorted, its body built (0.75 measured here)
    value_us: float = 1.0  # a table's distinct value: decoded and checked, once per rank (0.98 measured here)
    fold_us: float = 0.2  # a leader's per row of a peer's table: unpacked and folded in (0.16 measured here)
    fanout: int = 2
    chunk_mib: float = 1.0
    keys: str = "device"  # or "job"
    local_hop_us: float = 30.0  # one message between two ranks of a host over gloo's loopback
    thread_us: float = 100.0  # starting and joining the helper thread of one tree exchange
    local_gbs: float = 3.0  # gloo's loopback between two ranks of a host, GB/s (3.2-4.0 measured here)
    result_kib: float = 8.0  # one source's encoded result
    heartbeat_s: float = 1.0  # COMPILER_COLLECTIVES_HEARTBEAT_S
    compile_s: float = 30.0  # how long the source's compile of one graph takes


TARGET_EXCHANGES = (1024, 10.0, 0.1)  # issue 37's check: hosts, Gb/s, seconds per graph for the exchanges
TARGET_FIRST_GRAPH_S = 0.02  # issue 43's: a first graph, and a graph with a miss round, at that row
POLL_S = (0.005, 0.2)  # before issue 37 item 2: the polling wait's first and longest sleep between looks
LOOK_REQUESTS = (
    4  # before: per pending source and look: the post's check, the failure key, the heartbeat's check and get
)
WAIT_REQUESTS = 2  # per waiting rank and graph: the blocking wait for all its sources' posts, their multi_get
ISSUE37_WAIT_REQUESTS = 1  # issue 37, per waiting rank and graph: its notice wait's store connection
ISSUE37_NOTICE_REQUESTS = 2  # issue 37, per source: the blocking wait for its post, and the get of it
ISSUE37_FIRST_READ_REQUESTS = 3  # issue 37, per source and graph: its failure key, whether it has a record, the record
HEARTBEAT_REQUESTS = 2  # per beat: the record's set, the failure count's add (with the watched records)


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


def sources(hosts: int, f: Figures) -> int:
    """The sources of one graph: one per key group; none where no two ranks share a key (one
    host of a GPU job: every rank compiles its own, and no result or load report follows)."""
    return 0 if f.keys == "device" and hosts == 1 else groups(hosts, f)[0]


def _rounds(hosts: int) -> int:
    """The leaders' recursive doubling (``hierarchy.doubling_plan``): the most steps any leader takes."""
    if hosts <= 1:
        return 0
    p = 1 << (hosts.bit_length() - 1)
    return (p.bit_length() - 1) + (2 if p != hosts else 0)


def record_bytes(f: Figures) -> int:
    """A tree record: its header and the keys' MIN values (``once.keys.record_width``: 8 + 4
    int64 per index on a host)."""
    return 8 * (TREE_HEAD + 8 + 4 * f.ranks_per_host)


def tree_min(hosts: int, link: float, f: Figures) -> dict[str, float]:
    """One MIN of a fixed record over the host tree (the keys; the load report's flags)."""
    us = 1e-6
    rec = record_bytes(f)
    rounds = _rounds(hosts)
    local = 2 * (f.local_hop_us * us + (f.ranks_per_host - 1) * f.send_us * us) if f.ranks_per_host > 1 else 0.0
    return {
        "time_s": local + rounds * (f.hop_us * us + 2 * f.send_us * us + rec / link) + f.thread_us * us,
        "rounds": rounds,
        "bytes_per_rank": rec,
        "leader_bytes": (f.ranks_per_host - 1) * rec + rounds * rec,
    }


def tree_gather(hosts: int, link: float, f: Figures, count: int, each: float) -> dict[str, float]:
    """One gather over the host tree of ``count`` entries of ``each`` bytes (``HostTree.gather``)."""
    us = 1e-6
    rec = record_bytes(f)
    rounds = _rounds(hosts)
    others = f.ranks_per_host - 1
    whole = count * (ENTRY_HEAD + each)  # the set every rank ends with
    power = hosts & (hosts - 1) == 0
    local = 2 * (f.local_hop_us * us + others * 2 * f.send_us * us) + others * whole / (f.local_gbs * 1e9)
    across = rounds * (f.hop_us * us + 4 * f.send_us * us + rec / link) + (whole if power else 2 * whole) / link
    return {
        "time_s": (local if others else 0.0)
        + (across if hosts > 1 else 0.0)
        + count * f.decode_us * us
        + f.thread_us * us,
        "rounds": rounds,
        "bytes_per_rank": 2 * rec + whole,
        "set_bytes": whole,
    }


def table_bytes(rows: int, columns: int, distinct: int, value_bytes: float) -> float:
    """A packed table (``transport/table.py``): its header, its values' lengths, a rank and an
    index per column for each row, the distinct values."""
    return 8 * (2 + columns + distinct) + 4 * rows * (1 + columns) + value_bytes


def tree_table(
    hosts: int, link: float, f: Figures, rows: int, columns: int, distinct: int, value_bytes: float
) -> dict[str, float]:
    """One table gather over the host tree (``HostTree.gather_table``): the gather's path with the
    table for the entries, the leaders' folds, and every rank reading the table once."""
    us = 1e-6
    whole = table_bytes(rows, columns, distinct, value_bytes)
    path = tree_gather(hosts, link, f, 0, 0.0)  # the messages' own cost: records, hops, the thread
    others = f.ranks_per_host - 1
    power = hosts & (hosts - 1) == 0
    carry = (others * whole / (f.local_gbs * 1e9) if others else 0.0) + (
        (whole if power else 2 * whole) / link if hosts > 1 else 0.0
    )
    folds = rows * f.fold_us * us + min(rows, others) * 7 * f.fold_us * us
    reads = rows * f.row_us * us + distinct * f.value_us * us
    return {
        "time_s": path["time_s"] + carry + folds + reads,
        "rounds": path["rounds"],
        "bytes_per_rank": path["bytes_per_rank"] + whole,
        "set_bytes": whole,
        "read_s": reads,
    }


def offer_table(hosts: int, link: float, f: Figures) -> dict[str, float]:
    """A generation's first graph's offers as a table: every rank's row; per device index a key
    and a graph (one of each with ``--keys job``), a dir per host, one value in each other column."""
    n, per_key = hosts * f.ranks_per_host, f.ranks_per_host if f.keys == "device" else 1
    distinct = 2 * per_key + hosts + (OFFER_COLUMNS - 3)
    values = per_key * (KEY_BYTES + GRAPH_BYTES) + hosts * DIR_BYTES + ROW_HEAD_BYTES + OFFER_OTHER_BYTES + BUILD_BYTES
    return tree_table(hosts, link, f, n, OFFER_COLUMNS, distinct, values)


def missed(hosts: int, f: Figures) -> int:
    """The ranks of a miss round, at worst: every rank that loads (the guards fail every loader's
    size hints)."""
    return hosts * f.ranks_per_host - sources(hosts, f) if sources(hosts, f) else 0


def before37(hosts: int, link: float, f: Figures) -> dict[str, float]:
    """The exchanges per graph before issue 37's item 3: the ring reduce of the keys (and, for a
    key per device on several hosts, the all-gather of offers), the result's all-gather (a second
    round past 4 KiB) and the load report's all-gather."""
    us = 1e-6
    n = hosts * f.ranks_per_host
    ag = all_gather(hosts, link, f)["time_s"]
    keys = 2 * (n - 1) * f.hop_us * us  # gloo's ring: its hops are gloo's own, not Python send calls
    shared = sources(hosts, f) > 0
    if f.keys == "device":
        keys += ag  # the digest held each rank's key: never the same on two ranks of a host
    r = f.result_kib * 1024
    second = r > SLOT_BYTES - 16
    result = ag + ((n - 1) * (f.hop_us * us + r / link) if second else 0.0) if shared else 0.0
    report = ag if shared else 0.0
    gathers = (f.keys == "device") + 2 * shared
    return {
        "keys_s": keys,
        "result_s": result,
        "report_s": report,
        "time_s": keys + result + report,
        "bytes_per_rank": gathers * (n - 1) * SLOT_BYTES + ((n - 1) * r if second and shared else 0),
    }


def host_keys(n: int, link: float, f: Figures) -> float:
    """The all-gather of host keys a generation's tree is built from (``hosttree.gather_ints``):
    Bruck's, ceil(log2 N) rounds of a send and a receive, 8(N - 1) bytes in all per rank."""
    us, held, t = 1e-6, 1, f.thread_us * 1e-6
    while held < n:
        step = min(held, n - held)
        t += f.hop_us * us + 2 * f.send_us * us + 8 * step / link
        held += step
    return t


def exchanges(hosts: int, link: float, f: Figures) -> dict[str, float]:
    """The exchanges per graph as built (``transport/hosttree.py``, ``agreements/once/exchanges.py``)."""
    n, k = hosts * f.ranks_per_host, sources(hosts, f)
    t = tree_min(hosts, link, f)
    results = tree_gather(hosts, link, f, k, f.result_kib * 1024) if k else None
    m = missed(hosts, f)
    details = tree_table(hosts, link, f, m, LOADED_COLUMNS, 3, OUTCOME_HEAD_BYTES + OUTCOME_BYTES + REASON_BYTES)
    offers = offer_table(hosts, link, f)
    report = t["time_s"] if k else 0.0
    steady = t["time_s"] + (results["time_s"] if results else 0.0) + report
    layout = host_keys(n, link, f)
    # Before issue 43: the same rounds gathered every contributor's payload, each decoded on every rank.
    old_details, old_offers = tree_gather(hosts, link, f, m, LOADED_BYTES), tree_gather(hosts, link, f, n, OFFER_BYTES)
    return {
        "keys_s": t["time_s"],
        "result_s": results["time_s"] if results else 0.0,
        "report_s": report,
        "time_s": steady,
        "missed": m,
        "with_miss_s": steady + details["time_s"] if k else steady,
        "miss_details_s": details["time_s"] if k else 0.0,
        "first_graph_s": steady + offers["time_s"] + layout,
        "offers_s": offers["time_s"],
        "offers_read_s": offers["read_s"],
        "before43_with_miss_s": steady + old_details["time_s"] if k else steady,
        "before43_first_graph_s": steady + old_offers["time_s"] + layout,
        "before43_offers_s": old_offers["time_s"],
        "layout_s": layout,
        "bytes_per_rank": (2 if k else 1) * t["bytes_per_rank"] + (results["bytes_per_rank"] if results else 0),
        "first_graph_bytes_per_rank": offers["bytes_per_rank"],
        "before43_first_graph_bytes_per_rank": old_offers["bytes_per_rank"],
        "rounds": t["rounds"],
    }


def looks(compile_s: float) -> int:
    """How often one waiting rank looks at the store for one source during a compile of ``compile_s``."""
    sleep, elapsed, count = POLL_S[0], 0.0, 1
    while elapsed < compile_s:
        elapsed += sleep
        count += 1
        sleep = min(sleep * 2, POLL_S[1])
    return count


def stale_after(heartbeat_s: float) -> float:
    """``health.liveness.stale_after``: how long a beat may stand still before a peer looks silent."""
    return 2.5 * heartbeat_s + 0.5


def store(hosts: int, f: Figures) -> dict[str, float]:
    """Requests per second at the job's one store: the heartbeat's, and compile once's waits as
    built (blocking, nothing periodic: issue 43), in issue 37 (blocking, the sources' records
    read once per stale_after) and before it (polling)."""
    n = hosts * f.ranks_per_host
    src = sources(hosts, f)
    waiters = n - src if src else 0
    heartbeat = HEARTBEAT_REQUESTS * n / f.heartbeat_s if f.heartbeat_s > 0 else 0.0
    # Issue 37: one multi_get of the sources' records per stale_after with heartbeats on; off,
    # each source's failure key every second.
    issue37 = waiters / stale_after(f.heartbeat_s) if f.heartbeat_s > 0 else waiters * src / 1.0
    issue37_first = ISSUE37_WAIT_REQUESTS + (ISSUE37_NOTICE_REQUESTS + ISSUE37_FIRST_READ_REQUESTS) * src
    polling = waiters * src * LOOK_REQUESTS / POLL_S[1]
    return {
        "heartbeat_per_s": heartbeat,
        "compile_wait_per_s": 0.0,
        "busiest_per_s": heartbeat,
        "compile_wait_per_graph": waiters * WAIT_REQUESTS + src,
        "issue37_compile_wait_per_s": issue37,
        "issue37_busiest_per_s": heartbeat + issue37,
        "issue37_compile_wait_per_graph": waiters * issue37_first + issue37 * f.compile_s + src,
        "before_compile_wait_per_s": polling,
        "before_busiest_per_s": heartbeat + polling,
        "before_compile_wait_per_graph": waiters * src * LOOK_REQUESTS * looks(f.compile_s) + src,
    }


def row(hosts: int, size_mb: float, link_gbps: float, f: Figures) -> dict[str, Any]:
    size, link = size_mb * MB, link_gbps * 1e9 / 8
    a, b = today(hosts, size, link, f), new(hosts, size, link, f)
    floor = size / link
    ex, old = exchanges(hosts, link, f), before37(hosts, link, f)
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
        "exchanges": {"before37": old, "built": ex, "all_gather": all_gather(hosts, link, f)},
        "store": store(hosts, f),
        "today_graph_s": a["time_s"] + 3 * all_gather(hosts, link, f)["time_s"],
        "before37_graph_s": b["time_s"] + old["time_s"],
        "new_graph_s": b["time_s"] + ex["time_s"],
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


def _best(fn: Any, times: int = 5) -> float:
    best = math.inf
    for _ in range(times):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def calibrate_tables(hosts: int = 1024, ranks_per_host: int = 8) -> dict[str, float]:
    """``row_us``, ``value_us`` and ``fold_us`` measured on the code itself (the package must be
    importable): a first graph's offers at ``hosts`` x ``ranks_per_host`` (a key and a graph per
    device index, a dir per host), each the best of five (~2 s)."""
    from compiler_collectives.agreements.wire.codec import failure, values_of
    from compiler_collectives.agreements.wire.once import Offer, decode_rows, encode_row
    from compiler_collectives.transport import Table

    n, limit = hosts * ranks_per_host, 1 << 20

    def offer(r: int, dirs: int) -> Offer:
        index, host = r % ranks_per_host, r // ranks_per_host % dirs
        return Offer(f"a{index:052d}", None, False, f"{host:036x}:2049:1234567", [], 1 << 30, f"{index:064x}", 0, BUILD)

    def halves(dirs: int) -> list[Table]:
        out = []
        for part in (range(n // 2), range(n // 2, n)):
            table = Table(OFFER_COLUMNS, n)
            for r in part:
                table.fold(Table.of_row(r, encode_row(world_size=n, seq=1, body=offer(r, dirs)), n), ValueError, int)
            out.append(table)
        return out

    def fold(packed: list[bytes]) -> Table:
        a, b = (Table.unpack(memoryview(p), n // 2, OFFER_COLUMNS, n, limit, ValueError) for p in packed)
        a.fold(b, ValueError, int)
        return a

    def read(packed: bytes) -> None:
        table = Table.unpack(memoryview(packed), n, OFFER_COLUMNS, n, limit, ValueError)
        table.sort()
        ranks = table.ranks()
        decode_rows([table.column(c) for c in range(OFFER_COLUMNS)], ranks, kind="keys", seq=1, world_size=n)

    one_dir = [t.pack() for t in halves(1)]
    whole = fold(one_dir).pack()
    dirs = fold([t.pack() for t in halves(hosts)]).column(4)[0]  # the dir column's distinct values
    per_value = _best(lambda: values_of(dirs, lambda j: failure("a", "a", j, "a"))) / len(dirs)
    return {
        "fold_us": _best(lambda: fold(one_dir)) / n * 1e6,
        "row_us": (_best(lambda: read(whole)) / n) * 1e6,  # its few distinct values: a few µs in all
        "value_us": per_value * 1e6,
    }


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
    parser.add_argument("--fanout", type=int, default=Figures.fanout, help="the artifact tree's (1: a chain)")
    parser.add_argument("--chunk-mib", type=float, default=Figures.chunk_mib)
    parser.add_argument("--keys", choices=("device", "job"), default=Figures.keys)
    parser.add_argument("--local-hop-us", type=float, default=Figures.local_hop_us, help="one message within a host")
    parser.add_argument("--thread-us", type=float, default=Figures.thread_us, help="a tree exchange's helper thread")
    parser.add_argument("--local-gbs", type=float, default=Figures.local_gbs, help="gloo's loopback, GB/s")
    parser.add_argument("--result-kib", type=float, default=Figures.result_kib, help="one source's encoded result")
    parser.add_argument(
        "--heartbeat-s", type=float, default=Figures.heartbeat_s, help="COMPILER_COLLECTIVES_HEARTBEAT_S"
    )
    parser.add_argument("--compile-s", type=float, default=Figures.compile_s, help="one graph's compile")
    parser.add_argument("--row-us", type=float, default=Figures.row_us, help="reading one row of a table")
    parser.add_argument("--value-us", type=float, default=Figures.value_us, help="a table's distinct value")
    parser.add_argument("--fold-us", type=float, default=Figures.fold_us, help="a leader folding in a row")
    parser.add_argument(
        "--calibrate", action="store_true", help="measure the SHA-256 rate and the tables' costs here (~2 s)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.fanout < 1 or args.ranks_per_host < 1 or args.chunk_mib <= 0:
        parser.error("--fanout >= 1, --ranks-per-host >= 1, --chunk-mib > 0")
    tables = calibrate_tables() if args.calibrate else {}
    f = Figures(
        ranks_per_host=args.ranks_per_host,
        hop_us=args.hop_us,
        send_us=args.send_us,
        hash_gbs=calibrate_hash() if args.calibrate else args.hash_gbs,
        decode_us=args.decode_us,
        row_us=tables.get("row_us", args.row_us),
        value_us=tables.get("value_us", args.value_us),
        fold_us=tables.get("fold_us", args.fold_us),
        fanout=args.fanout,
        chunk_mib=args.chunk_mib,
        keys=args.keys,
        local_hop_us=args.local_hop_us,
        thread_us=args.thread_us,
        local_gbs=args.local_gbs,
        result_kib=args.result_kib,
        heartbeat_s=args.heartbeat_s,
        compile_s=args.compile_s,
    )
    hosts = [int(h) for h in _floats(args.hosts)]
    rows = [row(h, s, b, f) for b in _floats(args.links_gbps) for s in _floats(args.sizes_mb) for h in hosts]
    target = row(*TARGET, f)
    goal_hosts, goal_link, goal_s = TARGET_EXCHANGES
    goal = row(goal_hosts, TARGET[1], goal_link, f)
    if args.json:
        out = {"figures": dataclasses.asdict(f), "rows": rows, "target": target, "target_exchanges": goal}
        json.dump(out, sys.stdout, indent=1)
        print()
        return
    print("once_scale_model (A MODEL, not a measurement at scale)")
    print(
        f"figures: {f.ranks_per_host} ranks per host, keys per {f.keys}, hop {f.hop_us:g} µs, send call "
        f"{f.send_us:g} µs, SHA-256 {f.hash_gbs:.2f} GB/s{' (measured here)' if args.calibrate else ''}, "
        f"decode {f.decode_us:g} µs a payload; new: fan-out {f.fanout}, {f.chunk_mib:g} MiB pieces; host tree: "
        f"local hop {f.local_hop_us:g} µs, loopback {f.local_gbs:g} GB/s, helper thread {f.thread_us:g} µs, "
        f"result {f.result_kib:g} KiB; "
        f"heartbeat {f.heartbeat_s:g} s, compile {f.compile_s:g} s"
    )
    print(
        "before: the transfer up to commit 801e892 (one copy per loader from the source); new: the tree "
        "of agreements/once/transfer.py; exchanges before issue 37 (ring reduce, all-gathers) and as built "
        "(transport/hosttree.py)\n"
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
        "| hosts | ranks | link | before 37: keys | before 37: result | before 37: load report | before 37: total "
        "| before 37: bytes per rank | built: tree MIN (rounds) | built: results | built: total "
        "| built: bytes per rank | built: with a miss | built: first graph | before 43: with a miss "
        "| before 43: first graph |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    seen = set()
    for r in rows:
        if (r["hosts"], r["link_gbps"]) in seen:
            continue
        seen.add((r["hosts"], r["link_gbps"]))
        o, e = r["exchanges"]["before37"], r["exchanges"]["built"]
        print(
            f"| {r['hosts']} | {r['ranks']} | {r['link_gbps']:g} Gb/s | {_t(o['keys_s'])} | {_t(o['result_s'])} "
            f"| {_t(o['report_s'])} | {_t(o['time_s'])} | {_b(o['bytes_per_rank'])} "
            f"| {_t(e['keys_s'])} ({e['rounds']}) | {_t(e['result_s'])} | {_t(e['time_s'])} "
            f"| {_b(e['bytes_per_rank'])} | {_t(e['with_miss_s'])} | {_t(e['first_graph_s'])} "
            f"| {_t(e['before43_with_miss_s'])} | {_t(e['before43_first_graph_s'])} |"
        )
    print(
        "\nStore requests per second at the job's one store (rank 0's), compile wait as built, in issue 37 "
        "(the sources' records read once per stale_after) and before it (polling):\n"
    )
    print(
        "| hosts | ranks | heartbeat | compile wait (steady) | busiest | compile wait, one graph "
        "| issue 37: compile wait (steady) | issue 37: one graph "
        "| polling: compile wait (steady) | polling: busiest | polling: one graph |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    seen = set()
    for r in rows:
        if r["hosts"] in seen:
            continue
        seen.add(r["hosts"])
        st = r["store"]
        print(
            f"| {r['hosts']} | {r['ranks']} | {st['heartbeat_per_s']:,.0f}/s | {st['compile_wait_per_s']:,.0f}/s "
            f"| {st['busiest_per_s']:,.0f}/s | {st['compile_wait_per_graph']:,.0f} "
            f"| {st['issue37_compile_wait_per_s']:,.0f}/s | {st['issue37_compile_wait_per_graph']:,.0f} "
            f"| {st['before_compile_wait_per_s']:,.0f}/s | {st['before_busiest_per_s']:,.0f}/s "
            f"| {st['before_compile_wait_per_graph']:,.0f} |"
        )
    t = target
    print(
        f"\nTarget (issue 30): {t['hosts']:,} hosts, {t['size_mb']:g} MB, {t['link_gbps']:g} Gb/s: "
        f"S/B = {_t(t['size_over_bw_s'])}; new {_t(t['new']['time_s'])} = {_x(t['new_over_floor'])} S/B "
        f"(depth {t['new']['depth']}, {t['new']['chunks']} pieces; target ~2x plus log-depth latency: "
        f"{'met' if (t['new_over_floor'] or 0) <= 2.5 else 'NOT met'}); before {_t(t['today']['time_s'])} = "
        f"{_x(t['today_over_floor'])} S/B ({t['hosts'] - 1:,} copies on one link, then the check), with "
        f"{_b(t['today']['source_ram_bytes'])} of send buffers in flight on the source; "
        f"{_x(t['speedup'])} faster."
    )
    e, o, st = goal["exchanges"]["built"], goal["exchanges"]["before37"], goal["store"]
    print(
        f"Target (issue 37): {goal_hosts:,} hosts x {f.ranks_per_host} ranks, {goal_link:g} Gb/s: the exchanges "
        f"per graph as built {_t(e['time_s'])} (at most {_t(goal_s)}: {'met' if e['time_s'] <= goal_s else 'NOT met'}; "
        f"before {_t(o['time_s'])}); with a miss {_t(e['with_miss_s'])}, a generation's first graph "
        f"{_t(e['first_graph_s'])} (the offers' gather {_t(e['offers_s'])}, the host keys' all-gather "
        f"{_t(e['layout_s'])}). Store: {st['busiest_per_s']:,.0f} requests/s at the busiest store while a "
        f"graph compiles ({st['heartbeat_per_s']:,.0f}/s of them heartbeats, {st['compile_wait_per_s']:,.0f}/s "
        f"compile once's waits, {st['compile_wait_per_graph']:,.0f} per graph; in issue 37 they read the sources' "
        f"records: {st['issue37_busiest_per_s']:,.0f}/s; before it they polled: {st['before_busiest_per_s']:,.0f}/s). "
        f"Per graph with the transfer: {_t(goal['new_graph_s'])} "
        f"(before issue 37: {_t(goal['before37_graph_s'])})."
    )
    first, miss, met = e["first_graph_s"], e["with_miss_s"], max(e["first_graph_s"], e["with_miss_s"])
    print(
        f"Target (issue 43): the same row: a generation's first graph {_t(first)} of exchanges (the offers' table "
        f"{_t(e['offers_s'])}, {_t(e['offers_read_s'])} of it reading {f.ranks_per_host * goal_hosts:,} rows), a "
        f"graph whose every loader missed ({e['missed']:,} outcomes) {_t(miss)} (each at most "
        f"{_t(TARGET_FIRST_GRAPH_S)}: {'met' if met <= TARGET_FIRST_GRAPH_S else 'NOT met'}; before, one payload "
        f"per rank decoded on every rank: {_t(e['before43_first_graph_s'])} and {_t(e['before43_with_miss_s'])}); "
        f"figures: {f.row_us:g} µs a row read, {f.value_us:g} µs a distinct value, {f.fold_us:g} µs a row folded "
        f"by a leader{' (measured here)' if args.calibrate else ''}."
    )


if __name__ == "__main__":
    main()
