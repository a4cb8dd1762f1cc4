"""The exchanges the agreements run on the compile group: their numbers, and how errors name them.

Each exchange's number travels with it: in the header of every slot of a byte all-gather
(``transport.all_gather_bytes``) and in the stamp of every host-tree record
(``transport.HostTree.stamp``); compile once's key record starts with its own. A rank that finds
a peer at another number raises ``CollectiveDesyncError`` naming what each rank is in, in the
words below (``transport.Phases``: the transport layer knows no exchange of ours). The numbers
are one series, so that no two exchanges on the group share one; they never change meaning
(``transport.PROTOCOL_VERSION`` would).
"""

from __future__ import annotations

from ..transport import Phases

INPUTS = 1  # the compiler collective's input exchange, before the first trace
TRACE = 2  # the compiler collective's end-of-trace exchange
ONCE_KEYS = 3  # compile once's key exchange
ONCE_RESULT = 4  # compile once's result exchange
ONCE_LOADED = 5  # compile once's load report
ONCE_TRANSFER = 6  # compile once's artifact transfer: its meeting of each parent and child (``HostTree.meet``)

# The compiler collective's byte all-gathers (``exchange.gather``).
ALL_GATHER = Phases(
    names={
        INPUTS: "the input exchange (before the first trace)",
        TRACE: "the end-of-trace exchange",
        ONCE_KEYS: "compile once's key exchange (at AOTAutograd's cache lookup)",
        ONCE_RESULT: "compile once's result exchange (after the graph compiled)",
        ONCE_LOADED: "compile once's load report",
    },
    advice=(
        "Every rank must run the same exchanges in the same order: a setting that decides whether the input "
        "exchange runs (COMPILER_COLLECTIVES_EXCHANGE_INPUTS_FIRST, COMPILER_COLLECTIVES_SKIP_NEEDLESS_RESTART, "
        "torch._dynamo.config.automatic_dynamic_shapes) was changed on some ranks only after the groups were created."
    ),
)

# Compile once's exchanges over the host tree (``once.exchanges``).
HOST_TREE = Phases(
    names={
        ONCE_KEYS: "compile once's keys",
        ONCE_RESULT: "compile once's results",
        ONCE_LOADED: "compile once's load report",
        ONCE_TRANSFER: "compile once's artifact transfer",
    },
    advice=(
        "Every rank of the group must take the same exchanges in the same order (compile once: every rank "
        "compiles the same graphs in the same order)."
    ),
)
