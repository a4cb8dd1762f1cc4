"""The store floor: everything of ours that talks to the c10d store, below transport and health.

One module per concern:

* ``calls``: bounded store calls (``bounded``, a thread each; ``StoreCaller``,
  one long-lived thread for the frequent ones), the count of store requests
  (``stats()["store_requests"]``), how messages name a store, and how to
  reach the default group's store (a source install wires);
* ``board``: one generation's side channel (``SideChannel``): the heartbeat
  and its thread, the failure reports, and the records of the peers a wait
  watches, which the heartbeat reads with its own request (``PeerRecords``);
* ``mailbox``: notices a rank leaves for its peers, and the blocking wait
  for them on a store connection of its own (``NoticeWait``: two requests
  per wait);
* ``rendezvous``: our rendezvous before each later group of a generation.

This layer writes and reads; what a record says of a peer (alive, stopped,
gone) is the health layer's verdict, and what a failure means for the job is
the agreements'. It imports only the base modules.
"""
