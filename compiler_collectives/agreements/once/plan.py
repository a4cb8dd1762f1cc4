"""Compile once's plan: from every rank's offer, what each rank does for one graph.

Pure: the same offers give the same plans on every rank, with no counters and no I/O, so it is
unit-tested on its own (``tests/unit/test_compile_once_plan.py``).
"""

from __future__ import annotations

import dataclasses

from ...errors import SetupMismatchError, ranks_text
from ..wire.once import WARMTH_COLD, WARMTH_FX, Offer

COMPILE, SERVE, LOAD, LOCAL = "compile", "serve", "load", "local"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one rank does for one graph, decided from every rank's offer identically everywhere."""

    role: str  # COMPILE, SERVE, LOAD or LOCAL
    source: int | None  # the global rank that compiles or serves this rank's key
    why: str  # for LOCAL: why; otherwise a short description
    shares_dir: bool  # LOAD: this rank's cache dir is the source's


def fallback_allowed(offers: dict[int, Offer]) -> bool:
    """Whether the FX compiles inside an AOTAutograd compile that no rank could share share at the
    FX graph cache instead: every rank bypassed AOTAutograd's cache for the same reason (a graph
    DDPOptimizer split, say), on an equal graph (so every rank runs the same inductor compiles in
    the same order), and none of torch's compile-time collectives is on."""
    first = next(iter(offers.values()))
    return bool(first.graph) and all(
        o.key is None and o.why == first.why and o.graph == first.graph and not o.switches for o in offers.values()
    )


def decide(offers: dict[int, Offer], seq: int, me: int | None = None) -> dict[int, Plan]:
    """Every rank's plan from every rank's offer (global rank -> offer); the same on every rank.
    ``me``: this rank, for errors."""
    ranks = sorted(offers)
    switch_sets = {r: tuple(offers[r].switches) for r in ranks}
    if len(set(switch_sets.values())) > 1:
        lines = "\n".join(f"  rank {r}: {', '.join(s) or 'none'}" for r, s in switch_sets.items())
        raise SetupMismatchError(
            "compile once: the ranks disagree about torch's compile-time collectives (they must match "
            f"across ranks: ranks that run them wait for ranks that do not):\n{lines}\n"
            "Set the same torch config on every rank.",
            kind="compile_once",
            rank=me,
            seq=seq,
        )
    on = switch_sets[ranks[0]]
    if on:
        why = f"torch's compile-time collectives are on ({', '.join(on)}): every rank compiles"
        return {r: Plan(LOCAL, None, why, False) for r in ranks}
    plans: dict[int, Plan] = {}
    by_key: dict[tuple[str, str], list[int]] = {}
    for r in ranks:
        key = offers[r].key
        if key is None:
            plans[r] = Plan(LOCAL, None, f"not cacheable here: {offers[r].why or 'no cache key'}", False)
        else:
            by_key.setdefault((key, offers[r].build), []).append(r)
    builds_of: dict[str, set[str]] = {}
    for key, build in by_key:
        builds_of.setdefault(key, set()).add(build)
    for turn, ((key, build), members) in enumerate(sorted(by_key.items(), key=lambda item: item[1])):
        # Ranks of another build fingerprint never share an artifact: each build compiles its own.
        apart = "" if len(builds_of[key]) == 1 else f"; ranks built as {build!r} share no artifact with other builds"
        if len(members) == 1:
            why = (
                "no other rank has this graph's cache key"
                if not apart
                else (
                    f"no other rank with its build has this graph's cache key (its build {build!r} differs from "
                    "theirs: it takes no kernel built for another CPU or compiler)"
                )
            )
            plans[members[0]] = Plan(LOCAL, None, why, False)
            continue
        holders = [r for r in members if offers[r].holds]
        warmest = max(offers[r].warmth for r in members)
        warm = [r for r in members if offers[r].warmth == warmest]
        if holders:
            source, role, done = holders[0], SERVE, "serves the entry its cache holds"
        elif warmest > WARMTH_COLD:
            # No entry anywhere: the warmest cache compiles fastest (its FX graph cache holds the
            # compiles, or the fullest dir, likely with kernels this graph needs); in turn among equals.
            source, role = warm[(seq + turn) % len(warm)], COMPILE
            done = (
                "compiles from its warm FX graph cache"
                if warmest == WARMTH_FX
                else f"compiles in the warmest cache dir ({warmest} FX graph entries)"
            )
        else:
            source, role, done = members[(seq + turn) % len(members)], COMPILE, "compiles"
        others = [r for r in members if r != source]
        plans[source] = Plan(role, source, f"{done} for {ranks_text(others)}{apart}", False)
        for r in others:
            plans[r] = Plan(LOAD, source, f"loads from rank {source}{apart}", offers[r].dir == offers[source].dir)
    return plans
