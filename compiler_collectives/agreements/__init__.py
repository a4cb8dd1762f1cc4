"""The agreements: what the ranks agree on, each in its own module.

* ``compiler``: the compiler collective (every rank's observations at a
  frame's first trace, and the restart decision);
* ``guard``: the guard collective (hit or miss, on every compiled call);
* ``audit`` with ``fingerprint``: the program audit (the same collectives in
  every rank's compiled graphs);
* ``entry``: entry agreement (every rank runs a cache entry with the same
  collective program);
* ``reasons``: every rank's recompile reasons after an agreed miss;
* ``setup`` and ``scope``: the setup check at each generation's first
  rendezvous (versions and settings across the job; a scope's ranks);
* ``exchange``: the one all-gather frame the byte exchanges share;
* ``failure``: what an agreement does when its exchange fails;
* ``generation``: what the agreements keep within a generation (sequence
  numbers, compile once's hosts), one object replaced at each new generation;
* ``wire``: the msgpack payloads, versioned and validated, one module per
  format (``compiler``, ``audit``, ``reasons``, ``setup``, ``scope``), each read
  through ``wire.codec``'s bounded reader.

Reset, a destroyed default group and a forked child are moments the package's
runtime (``runtime.py``) runs: it builds each generation's state and hands
each layer its part.

Plain Python over ``torch.distributed``; the Dynamo seam (``dynamo/``) calls in,
and connects them at install (``dynamo/wiring.py``): no module here registers
anything when imported.
"""
