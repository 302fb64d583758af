"""The name of every key kvroute keeps in Redis, in one place.

Every key starts with the namespace (``index.namespace``). Keys that a script or a multi-key
command uses together carry one hash tag (``{...}``), so that on a Redis Cluster they live in one
slot: a model's index, a replica's KV-event lease, the shared load picture. A session and the
replica list are single keys. Names a client or a replica chooses (models, replicas) have their
braces replaced, so that they cannot change a key's tag.
"""

from __future__ import annotations


def _tag(name: str) -> str:
    return name.replace("{", "(").replace("}", ")")


class Layout:
    def __init__(self, namespace: str = "kvroute") -> None:
        self.ns = namespace
        self._load = f"{namespace}:{{{_tag(namespace)}:load}}:"
        self._health = f"{namespace}:{{{_tag(namespace)}:health}}:"

    # the prefix index (router.index.redis): one slot per model
    def model(self, model: str) -> str:
        """The prefix of every index key of one model."""
        return f"{self.ns}:{{{_tag(model)}}}:"

    def replica_blocks(self, model: str, replica: str) -> str:
        """The blocks routed to a replica (a sorted set by last use)."""
        return f"{self.model(model)}r:{replica}"

    def replica_exact(self, model: str, replica: str) -> str:
        """The blocks a replica's KV-cache events say it holds."""
        return f"{self.model(model)}x:{replica}"

    def holders_prefix(self, model: str) -> str:
        """Followed by a block's 8 bytes: the set of replicas holding that block."""
        return f"{self.model(model)}w:"

    def clock(self, model: str) -> str:
        """The model's use counter (stamps of the sorted sets)."""
        return f"{self.model(model)}clock"

    # sessions (router.sessions)
    def session(self, session: str) -> str:
        return f"{self.ns}:s:{session}"

    # membership (router.replicas.membership)
    def replicas(self) -> str:
        """Replicas registered through the admin API, for every router."""
        return f"{self.ns}:replicas"

    # KV-event leases (router.kv_events.lease): one slot per replica
    def lease(self, replica: str, what: str) -> str:
        return f"{self.ns}:events:{{{_tag(replica)}}}:{what}"

    def lease_routers(self) -> str:
        """The routers taking part in the leases, scored by when they last said so (for a fair share each)."""
        return f"{self.ns}:{{{_tag(self.ns)}:events}}:routers"

    # the shared load picture (router.shared_load): one slot
    def load_routers(self) -> str:
        """The routers publishing load, scored by when they last did."""
        return self._load + "routers"

    # shared health checks (router.replicas.shared_health): one slot
    def health_routers(self) -> str:
        """The routers sharing the health checks, scored by when they stop counting (ms)."""
        return self._health + "routers"

    def health_verdicts(self) -> str:
        """Replica name -> the verdict of the router that checks it ("ready", "starting", "unready WHY")."""
        return self._health + "verdicts"

    def health_version(self) -> str:
        """A token that changes with every change of the verdicts (readers read them again only then)."""
        return self._health + "version"

    def conversations(self) -> str:
        """A stream of what the routers answered and continued (router.shared_conversations)."""
        return self._load + "conversations"

    # tenants (router.tenants, router.budgets): the admin API's changes, and one bucket slot per tenant
    def tenants(self) -> str:
        """Tenant name -> its settings as the admin API last set them (keys as digests), or a tombstone."""
        return f"{self.ns}:tenants"

    def tenant_bucket(self, tenant: str) -> str:
        """A tenant's request and token buckets, shared by every router."""
        return f"{self.ns}:{{{_tag(self.ns)}:tenant:{_tag(tenant)}}}:bucket"

    def load_prefix(self) -> str:
        """Followed by a router's id: its figures per replica."""
        return self._load + "r:"
