"""The router decides; it does not send.

:meth:`Decider.route` takes a request and returns a :class:`Ticket` naming the replica, with the
predicted cached tokens and the reason for the choice. Before the first attempt it keys the
prompt, looks it up in the prefix index and finds the session's last replica; then the policy
chooses among immutable replica views and admission takes a slot (or queues). The proxy sends the
request and tells the ticket how it went:

- ``first_byte(status)``: the replica answered; its pending prefill is done, and a 2xx answer
  makes the request's session remember the replica;
- ``failed(kind)``: the attempt failed before the answer (see :data:`router.failure_kinds.KINDS`): the
  slot goes back, the index record made for it is withdrawn, the replica is not tried again for
  this request, and a connection refused takes it out of rotation;
- ``finish(status)``: the answer ended: the slot goes back, the decision is counted, and after a 2xx
  answer the request's conversation waits at the replica for its next turn.

The ticket owns everything routing needs to hear about a request; nothing else changes the load
table, the index, the sessions or the conversations on a request's behalf.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Sequence

from . import errors
from .admission import Admission
from .background import Background
from .candidates import Candidates
from .conversations import Conversations
from .errors import GatewayError
from .replica_events import Event, EventBus, ReplicaRemoved, ReplicaRestarted
from .failure_kinds import KINDS
from .index import PrefixIndex, Receipt
from .prompt_keys import PromptKeys
from .load import LoadTable
from .metrics import Metrics
from .config import SloConfig
from .policy import NoCandidate, Policy, predict
from .replicas import Replica, ReplicaPool
from .request import RouteRequest
from .responses import ResponseHomes
from .sessions import Sessions
from .shared_load import SharedLoad
from .view import ReplicaView

log = logging.getLogger("kvroute.routing")

_SIZES_INTERVAL_S = 5.0


def cached_tokens(matched_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """Tokens a replica would serve from cache: whole blocks, and never the prompt's last token (as vLLM)."""
    return min(matched_blocks * block_size, (prompt_tokens - 1) // block_size * block_size) if prompt_tokens else 0


class Ticket:
    """One attempt's routing: where it goes, and what routing must hear back about it."""

    __slots__ = ("_decider", "req", "replica", "name", "cached_tokens", "reason", "learns_tokens", "_pending",
                 "_receipts", "prompt_ends", "_open", "model_s", "predicted_s", "running", "decided_at")

    def __init__(self, decider: "Decider", req: RouteRequest, replica: Replica, cached: int, reason: str | None,
                 pending: int, receipts: list[Receipt], prompt_ends: list[int], model_s: float = 0.0,
                 predicted_s: float | None = None, running: float = 0.0) -> None:
        self._decider = decider
        self.req = req
        self.replica = replica  # for sending (its upstream connections); routing state lives elsewhere
        self.name = replica.name
        self.cached_tokens = cached
        self.reason = reason  # cache, load or fallback; None when the prompt was not keyed
        # keyed in byte mode: the replica's usage.prompt_tokens teaches the model's bytes per token
        self.learns_tokens = req.key is not None and req.key.in_bytes
        self._pending = pending
        self._receipts = receipts
        self.prompt_ends = prompt_ends  # the last block of each prompt: where its conversation waits once answered
        self._open = True
        # its time to first token as predicted at the decision (router.policy.predict): the model's prefill, and
        # the whole with the replica's line (None: not predicted, the prompt was not keyed); the sequences running
        # there then
        self.model_s = model_s
        self.predicted_s = predicted_s
        self.running = running
        self.decided_at = time.perf_counter()  # what the prediction counts from

    @property
    def predicted_since_arrival_s(self) -> float | None:
        """The predicted time to first token counted as the client counts it: from when the request arrived (its
        body read, keyed, queued and any earlier attempt included), not from this decision."""
        if self.predicted_s is None:
            return None
        return self.predicted_s + max(0.0, self.decided_at - self.req.arrived) if self.req.arrived else self.predicted_s

    def first_byte(self, status: int, first_token: bool = False) -> None:
        """The replica sent its first byte: the prompt's prefill is no longer pending there. ``first_token``: that
        byte carries the first token (a stream's first event, a prefill's answer), timed against the prediction
        from the decision on (the router's own time to send it included, as a client sees it)."""
        self._prefilled()
        if 200 <= status < 300:
            if first_token and self.predicted_s is not None:
                self._decider.pool.corrections.first_token(self.replica, self.model_s, self.predicted_s,
                                                           time.perf_counter() - self.decided_at)
            # now, not at the end: the session's next turn may come through another router mid-stream
            if self.req.session_id is not None:
                self._decider.sessions.remember(self.req.session_id, self.name)
            if self.req.response_id is not None and self._decider.responses is not None:
                self._decider.responses.remember(self.req.response_id, self.name)

    def failed(self, kind: str) -> None:
        """The attempt failed before an answer reached the client."""
        if self._open:
            self._open = False
            self._prefilled()
            self._decider._failed(self, kind)

    def finish(self, status: int, prompt_tokens: int | None = None, broken: str | None = None,
               per_token_s: float | None = None) -> None:
        """The answer ended (completed, broken mid-stream, or the client left); ``prompt_tokens`` is the
        replica's count of the prompt, when its answer said; ``broken`` the failure kind that ended a
        stream the replica broke; ``per_token_s`` a whole stream's seconds per output token after its first."""
        if self._open:
            self._open = False
            self._prefilled()
            if per_token_s is not None and broken is None and 200 <= status < 300:
                self._decider.pool.corrections.per_token(self.replica, self.running, per_token_s)
            self._decider._finished(self, status, prompt_tokens)
            if broken is not None or (0 < status < 500 and status != 499):  # a client leaving says nothing
                self._decider._judge(self, broken)

    def _prefilled(self) -> None:
        if self._pending:
            self._decider.load.add_pending(self.name, -self._pending)
            self._pending = 0


class Decider:
    """Where each request goes: keys its prompt, looks up the index and the session, runs the policy, takes a
    slot, and hands out a :class:`Ticket`; hears back from the ticket how the request went."""

    def __init__(self, pool: ReplicaPool, load: LoadTable, policy: Policy, admission: Admission,
                 sessions: Sessions, metrics: Metrics, events: EventBus,
                 index: PrefixIndex | None = None, keys: PromptKeys | None = None,
                 conversations: Conversations | None = None, candidates: Candidates | None = None,
                 responses: ResponseHomes | None = None, shared_load: SharedLoad | None = None,
                 slo: SloConfig | None = None, kv_read_cost: float = predict.KV_READ_COST) -> None:
        self.pool = pool
        self.load = load
        self.policy = policy
        self.admission = admission
        self.sessions = sessions
        self.metrics = metrics
        self.index = index
        self.keys = keys
        self.conversations = conversations
        self.candidates = candidates  # None: every decision weighs every replica
        self.responses = responses  # where each stored response lives (/v1/responses)
        self.shared_load = shared_load  # the other routers' load, read again before a decision where stale
        self.slo = slo or SloConfig()
        self.kv_read_cost = kv_read_cost
        self._m_lookup = metrics.index_lookup
        self._m_decision = metrics.decision
        self._background = Background()
        events.subscribe(self._on_event)

    # -- deciding --------------------------------------------------------------------------

    async def route(self, req: RouteRequest) -> Ticket:
        """Choose a replica for ``req`` and take a slot there (waiting in the queue if all are full).

        Raises :class:`~router.errors.GatewayError`: 404 (no replica serves the model), 503 (none
        ready or all drained or all tried), 429 (queue full or waited too long).
        """
        started = time.perf_counter()
        if req.prepared:
            started -= req.prepare_s  # prepared ahead (to tell whether to split it): its time is this decision's
        else:
            await self.prepare(req)
        req.prepare_s = 0.0
        view, waited_s = await self._admit(req)
        key = req.key
        keyed = key is not None and self.index is not None and req.model is not None
        pending = req.uncached(view.name) if keyed else 0
        if pending:  # with the slot, before any wait: the other routers' next read sees both (router.shared_load)
            self.load.add_pending(view.name, pending)
            if self.shared_load is not None:
                view, pending = await self._claim(req, view, pending, self.shared_load)
        self._m_decision.observe(time.perf_counter() - started - waited_s)
        replica = self.pool.get(view.name)
        assert replica is not None
        name = view.name
        receipts: list[Receipt] = []
        tails: list[int] = []
        reason: str | None = None
        cached = 0
        model = 0.0
        predicted: float | None = None
        if keyed:
            assert key is not None and self.index is not None and req.model is not None
            cached = req.cached.get(name, 0)
            if req.index_fallback:
                reason = "fallback"
            elif cached > 0 and cached >= req.best_cached:
                reason = "cache"
            else:
                reason = "load"
            chains = key.chains(view.block_size)
            if self.conversations is not None:
                tails = [chain[-1] for chain in chains if chain]
                self.conversations.routed(tails)
                if req.continues is not None:  # it left the table: a retry elsewhere does not resume it again
                    self.conversations.resume(req.continues)
                    req.continues = None
            try:
                for chain in chains:
                    receipt = await self.index.record(req.model, name, chain, view.kv_blocks)
                    if receipt is not None:
                        receipts.append(receipt)
            except Exception:  # the index is advice: a request never fails because of it
                log.exception("prefix index record failed", extra={"request_id": req.request_id})
            except BaseException:
                self._abandon(req, name, pending)
                raise
            model = predict.model_s(req, view, self.kv_read_cost)
            predicted = predict.on_line(view, model)
        if req.trace is not None:
            self._traced(req, started, waited_s, view, reason, cached, predicted)
        return Ticket(self, req, replica, cached, reason, pending, receipts, tails, model, predicted, view.load)

    def _abandon(self, req: RouteRequest, name: str, pending: int) -> None:
        """Cancelled (the client left) before a ticket owns the slot on ``name`` and its pending prefill."""
        if pending:
            self.load.add_pending(name, -pending)
        self.admission.release(name, req.rank)

    async def _claim(self, req: RouteRequest, view: ReplicaView, pending: int,
                     shared: SharedLoad) -> tuple[ReplicaView, int]:
        """Where other routers share the load picture, a placement of a long prefill is published, and the others'
        figures there read, in one round trip before the request is sent (router.shared_load): two routers deciding
        within the same few milliseconds both see the replica free, and the one whose claim Redis ran second
        chooses again, knowing of the first (four routers at the pressure run's knee: TTFT p90 1.32x one router's
        without claims, 1.08x with them; docs/benchmarks.md). Returns the replica and the pending prefill counted
        there (``pending`` on ``view`` as counted by the caller, moved with the slot where the decision moves)."""
        threshold = shared.cfg.claim_min_tokens
        if threshold is None or pending < max(1, threshold) or not shared.contended():
            return view, pending
        name = view.name
        seen = shared.others(name)[1]
        try:
            fresh = await shared.claim(name)
        except BaseException:
            self._abandon(req, name, pending)
            raise
        m = self.metrics
        if fresh is None or fresh[1] <= seen:
            m.child(m.claims, "unanswered" if fresh is None else "kept").inc()
            return view, pending
        moved = self.admission.move(req, name)
        m.child(m.claims, "stayed" if moved is None else "moved").inc()
        if moved is None:
            return view, pending
        self.load.add_pending(name, -pending)
        pending = req.uncached(moved.name)
        if pending:
            self.load.add_pending(moved.name, pending)
        return moved, pending

    @staticmethod
    def _traced(req: RouteRequest, started: float, waited_s: float, view: ReplicaView, reason: str | None,
                cached: int, predicted: float | None) -> None:
        """Note the decision on the request's trace: the replica, why, what it weighed, and the wait."""
        trace = req.trace
        assert trace is not None
        now = time.perf_counter()
        attrs = {"kvroute.replica": view.name, "kvroute.reason": reason or "unkeyed", "kvroute.phase": req.phase,
                 "kvroute.cached_tokens": cached, "kvroute.load": view.load, **trace.decided}
        if predicted is not None:
            attrs["kvroute.predicted_ttft_ms"] = round(predicted * 1e3, 3)
        span = trace.add("kvroute.route", started, now, **attrs)
        if waited_s > 0:
            trace.add("kvroute.queue", now - waited_s, now, parent=span, **{"kvroute.tenant": req.tenant,
                                                                            "kvroute.class_rank": req.rank})

    async def _admit(self, req: RouteRequest) -> tuple[ReplicaView, float]:
        """Admission's replica and the seconds ``req`` waited for it; a latency target no replica is predicted
        to meet is answered at once (slo.on_miss reject) or dropped (route)."""
        try:
            view, _, waited_s = await self.admission.admit(req)
            return view, waited_s
        except NoCandidate as e:
            if e.why != "slo_unmet":
                raise self._unroutable(req, e) from None
        rejected = self.slo.on_miss == "reject"
        for target in ("ttft", "tpot"):
            if getattr(req, f"slo_{target}_s") is not None:
                self.metrics.child(self.metrics.slo, target, "rejected" if rejected else "routed").inc()
        if rejected:
            raise self.slo_error(req)
        req.slo_ttft_s = req.slo_tpot_s = None
        try:
            view, _, waited_s = await self.admission.admit(req)
        except NoCandidate as e:
            raise self._unroutable(req, e) from None
        return view, waited_s

    def slo_error(self, req: RouteRequest) -> GatewayError:
        """503 naming the latency target of ``req`` that no ready replica serving it is predicted to meet, with
        the best prediction."""
        views = self.pool.views(req.candidates)
        if req.slo_ttft_s is not None:
            best = predict.soonest(req, views, self.kv_read_cost)
            spent = time.perf_counter() - req.arrived
            if best is None or spent + best > req.slo_ttft_s:
                return errors.slo_unattainable("ttft", req.slo_ttft_s * 1e3,
                                               None if best is None else (spent + best) * 1e3)
        best = min((predict.tpot(v) for v in views
                    if v.tpot_s and v.ready and (req.model is None or req.model in v.models)), default=None)
        return errors.slo_unattainable("tpot", (req.slo_tpot_s or 0.0) * 1e3, None if best is None else best * 1e3)

    async def prepare(self, req: RouteRequest) -> None:
        """Once per request: session, prompt key, the predicted cached tokens and the requests expected back
        per replica (and, where it is older than ``shared_load.max_age_s``, the other routers' load)."""
        req.prepared = True
        started = time.perf_counter()
        shared = self.shared_load  # the other routers' placements until now, read beside the lookups
        fresh = asyncio.ensure_future(shared.refresh()) if shared is not None and shared.stale() else None
        if req.session_id is not None:
            req.session_replica = await self.sessions.get(req.session_id)
        if self.keys is not None and req.payload is not None and req.model is not None:
            keyed = time.perf_counter()
            req.key = await self.keys.key(req.endpoint, req.payload, req.model)
            if req.trace is not None:
                req.trace.add("kvroute.prompt_key", keyed, time.perf_counter(), **{
                    "kvroute.keyed": req.key is not None,
                    "kvroute.key_mode": "none" if req.key is None else "bytes" if req.key.in_bytes else "tokens"})
        req.payload = None
        if req.key is not None and self.index is not None:
            looked = time.perf_counter()
            await self._lookup(req)
            if req.trace is not None:
                req.trace.add("kvroute.index_lookup", looked, time.perf_counter(), **{
                    "kvroute.prompt_tokens": req.prompt_tokens, "kvroute.replicas_weighed": len(req.cached),
                    "kvroute.best_cached_tokens": req.best_cached,
                    "kvroute.index_fallback": req.index_fallback})
        if fresh is not None:
            await fresh
        req.prepare_s = time.perf_counter() - started

    async def _lookup(self, req: RouteRequest) -> None:
        """Fill ``req.cached`` and ``req.occupancy`` for the replicas its decision weighs (see
        :mod:`router.candidates`), and ``req.candidates`` when those are not all of them."""
        key = req.key
        index = self.index
        model = req.model
        assert key is not None and index is not None and model is not None
        tokens = key.prompt_tokens()
        req.prompt_tokens = sum(tokens)
        started = time.perf_counter()
        weighed: list[ReplicaView] | None = None
        if self.candidates is not None and self.candidates.is_large(model):
            blocks = self.candidates.block_sizes(model)
            chains = [c for block in blocks for c in key.chains(block)]
            if self.conversations is not None:
                self._history(req, chains)
            also = (req.session_replica, req.continues.replica if req.continues else None)
            weighed = await self.candidates.select(model, chains, also)
            if weighed is not None:
                req.candidates = tuple(v.name for v in weighed)
        if weighed is None:
            weighed = [r.view for r in self.pool if r.view.ready and model in r.view.models]
        by_block: dict[int, list[ReplicaView]] = {}
        for v in weighed:
            by_block.setdefault(v.block_size, []).append(v)
        for block, group in by_block.items():
            names = [v.name for v in group]
            matched = dict.fromkeys(names, 0)
            held = dict.fromkeys(names, 0)
            # one lookup per prompt; a batch of prompts is keyed prompt by prompt
            for chain, n_tokens in zip(key.chains(block), tokens):
                probe = await index.probe(model, chain, names)
                if probe.degraded:
                    req.index_fallback = True
                for name, m in probe.matches.items():
                    matched[name] += cached_tokens(m.blocks, block, n_tokens)
                    held[name] = m.held
            req.cached.update(matched)
            req.best_cached = max(req.best_cached, max(matched.values(), default=0))
            for v in group:
                req.occupancy[v.name] = min(1.0, held[v.name] / v.kv_blocks)
        if self.conversations is not None:
            if req.candidates is None:
                self._history(req, [c for block in by_block for c in key.chains(block)])
            req.returning = self.conversations.expected(req.continues.replica if req.continues else None,
                                                        req.candidates)
        self._m_lookup.observe(time.perf_counter() - started)

    def _history(self, req: RouteRequest, chains: list[Sequence[int]]) -> None:
        """The conversation waiting between turns that ``req`` continues, if any, and whether it holds the end of
        any prompt routed before it (its own history, which the cost prices as such); if not, it may start a
        conversation, and the cost weighs load by the turns one is expected to send."""
        assert self.conversations is not None
        req.continues = self.conversations.find(chains)
        req.extends_earlier = req.continues is not None or self.conversations.extends(chains)
        if not req.extends_earlier:
            req.turns_ahead = self.conversations.turns_ahead()

    def _unroutable(self, req: RouteRequest, e: NoCandidate) -> GatewayError:
        if e.why == "unknown_model":
            if not any(req.model in r.config.models for r in self.pool):
                return errors.model_not_found(req.model or "")
        return errors.no_ready_replica(req.model)

    # -- what tickets report ---------------------------------------------------------------

    def _failed(self, ticket: Ticket, kind: str) -> None:
        req = ticket.req
        req.exclude[ticket.name] = ticket.replica.restarts
        if ticket._receipts and self.index is not None:
            for receipt in ticket._receipts:
                self._background.spawn(self._withdraw(receipt))
        failure = KINDS[kind]
        if failure.health == "eject":
            self.pool.health.mark_failure(ticket.replica, f"{failure.message} (proxy)", immediate=True)
        self._judge(ticket, kind)
        self.admission.release(ticket.name, ticket.req.rank)

    def _judge(self, ticket: Ticket, kind: str | None) -> None:
        """Passive outlier detection: what this attempt's end says of its replica (a failure kind, or None
        for an answer that went through)."""
        if kind is None:
            self.pool.health.request_outcome(ticket.replica, False)
        elif KINDS[kind].health != "ignore":
            self.pool.health.request_outcome(ticket.replica, True, KINDS[kind].message)

    async def _withdraw(self, receipt: Receipt) -> None:
        assert self.index is not None
        try:
            await self.index.withdraw(receipt)
        except Exception:
            log.exception("prefix index withdrawal failed")

    def _finished(self, ticket: Ticket, status: int, prompt_tokens: int | None) -> None:
        req = ticket.req
        self.admission.release(ticket.name, req.rank)
        if ticket.prompt_ends and self.conversations is not None and 200 <= status < 300:
            self.conversations.answered(ticket.name, ticket.prompt_ends)
        if prompt_tokens and self.keys is not None and req.key is not None and req.model is not None:
            self.keys.observe(req.model, req.key, prompt_tokens)
        if ticket.reason is not None:
            m = self.metrics
            model = req.model or ""
            m.child(m.prompt_tokens, model).inc(req.prompt_tokens)
            m.child(m.cached_tokens, model).inc(ticket.cached_tokens)
            m.child(m.decisions, ticket.reason).inc()

    # -- lifecycle -------------------------------------------------------------------------

    def _on_event(self, event: Event) -> None:
        if self.index is not None and isinstance(event, (ReplicaRestarted, ReplicaRemoved)):
            replica = self.pool.get(event.replica)
            models = sorted(replica.models) if replica is not None else []
            self._background.spawn(self._forget(event.replica, models))
        if self.conversations is not None and isinstance(event, ReplicaRemoved):
            self.conversations.forget(event.replica)

    async def _forget(self, replica: str, models: list[str]) -> None:
        assert self.index is not None
        await self.index.forget(replica, models)
        log.info("prefix index: forgot everything replica %s held", replica, extra={"replica": replica})

    async def start(self) -> None:
        if self.index is not None:
            await self.index.start()
            self._background.spawn(self._sizes_loop())

    async def _sizes_loop(self) -> None:
        assert self.index is not None
        while True:
            await asyncio.sleep(_SIZES_INTERVAL_S)
            if self.conversations is not None:  # in memory: a shared index that fails does not hold it back
                waiting = self.conversations.waiting()
                for r in self.pool:
                    self.metrics.conversations_waiting.labels(r.name).set(waiting.get(r.name, 0))
            try:
                for r in self.pool:
                    total = 0
                    for model in r.models:
                        total += await self.index.size(model, r.name)
                    self.metrics.index_blocks.labels(r.name).set(total)
            except Exception:
                log.exception("index size refresh failed")

    async def close(self) -> None:
        await self._background.close()
        if self.keys is not None:
            await self.keys.close()
        if self.index is not None:
            await self.index.close()
        await self.sessions.close()
        if self.responses is not None:
            await self.responses.close()
