"""The replica side: each replica's record, its checks and scrapes, its state, what it serves, who is in
the fleet.

- :mod:`.record`: :class:`Replica`, one replica's configuration and what the router learned about it;
- :mod:`.control`: health checks and scrapes on each replica's own connection, paced to the fleet's size;
- :mod:`.health`: the state machine (starting, ready, unready, ejected) and the verdicts that move it;
- :mod:`.scrape` and :mod:`.stats`: what its ``/metrics`` page tells (load, KV cache, restarts, stalls);
- :mod:`.prefill` and :mod:`.learning`: its prefill speed, learned from its metrics and shared among replicas of
  its kind;
- :mod:`.models`: what its ``/v1/models`` lists, bounded;
- :mod:`.pool`: :class:`ReplicaPool`, the replicas and the parts above put together;
- :mod:`.membership`: who joins and leaves (configuration, admin API, file, shared store), and drains.
"""

from .pool import ReplicaPool
from .record import Replica

__all__ = ["Replica", "ReplicaPool"]
