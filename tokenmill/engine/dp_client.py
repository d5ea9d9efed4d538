"""Data parallelism: N engine cores, each in its own process, behind one front end (issue 9).

`DPClient` is an EngineCoreClient over N MPClients: the router (engine/router.py) picks a replica
per request, outputs of all replicas are merged step by step, statistics are summed (and kept per
replica for the `replica` label of /metrics). When a replica dies, its in-flight requests fail with
an error naming it (an EngineStepError for those requests only), the others keep serving, and a
fresh replica is started in the background and joins the rotation when it is ready.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

import msgspec
import zmq

from tokenmill.config import EngineConfig
from tokenmill.core.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerLoad, SchedulerStats
from tokenmill.engine.core_client import EngineCoreClient
from tokenmill.engine.mp_client import MPClient
from tokenmill.engine.router import PrefixAffinityRouter
from tokenmill.errors import EngineDeadError, EngineStepError, ServiceUnavailableError
from tokenmill.utils.cpu import thread_share

logger = logging.getLogger(__name__)

_POLL_MS = 1000
_COUNTERS = ("prefix_queries", "prefix_hits", "num_preemptions")


class ReplicaStats(msgspec.Struct):
    replica: int
    alive: bool
    scheduler: SchedulerStats
    generation_tokens: int  # cumulative, over every incarnation of this replica


class DPClient(EngineCoreClient):
    runs_in_process = False

    client_class = MPClient  # one replica's client

    def __init__(self, config: EngineConfig, size: int, policy: str = "affinity", restart: bool = True):
        self.config = config = self.replica_config(config, size)
        self._restarted: list[tuple[int, MPClient]] = []  # filled by restart threads
        self._restart_lock = threading.Lock()
        self.replicas: list[MPClient | None] = []
        try:
            for i in range(size):
                self.replicas.append(self.client_class(config, replica=i, wait=False))
            for r in self.replicas:
                r.wait_ready()
        except BaseException as e:
            logger.error("data-parallel start-up failed: %s: %s", type(e).__name__, e)
            self.shutdown()
            raise
        self.max_model_len = self.replicas[0].max_model_len
        self.num_blocks = sum(r.num_blocks for r in self.replicas)
        self.router = PrefixAffinityRouter(size, config.cache.block_size, policy)
        self.restart = restart
        self._owner: dict[str, tuple[int, int]] = {}  # request id -> (replica, routed cost)
        self._generated = [0] * size
        self._sent = [0] * size  # sequences sent to each replica's current core
        self._retired_received = 0  # sequences sent to replicas that died: settled, never reported
        self._retired = {name: 0 for name in _COUNTERS}  # counters of replicas that died
        self._pending: list[BaseException] = []  # raised by the next get_output (outputs came first)
        self._poller = zmq.Poller()
        for r in self.replicas:
            for item in r.poll_items:
                self._poller.register(item, zmq.POLLIN)

    @staticmethod
    def replica_config(config: EngineConfig, size: int) -> EngineConfig:
        """Replicas on this machine share its cores: each gets its share of --num-threads (every
        core by default), as tensor-parallel ranks do. Each with every core, two replicas' thread
        teams wait on each other: on 2 cores, 8 streams fell from ~40 to 3-4 tok/s after a restart."""
        per = thread_share(config.parallel.num_threads, size)
        logger.info("data parallel: %d replicas, %d thread(s) each", size, per)
        return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, num_threads=per))

    @property
    def healthy(self) -> bool:
        return any(r is not None for r in self.replicas)

    def add_request(self, request: EngineCoreRequest) -> None:
        cost = len(request.prompt_token_ids) + request.max_tokens
        while True:
            if not self.healthy:
                raise ServiceUnavailableError("no replica is running; they are restarting")
            replica = self.router.route(request.prompt_token_ids, cost, request.cache_salt)
            try:
                self.replicas[replica].add_request(request)
            except EngineDeadError as e:  # died before its sentinel was polled: the request never
                self._replica_died(replica, e)  # reached it, so it goes to another replica
                continue
            self._owner[request.request_id] = (replica, cost)
            self._sent[replica] += 1
            return

    def abort_requests(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            owner = self._owner.pop(rid, None)
            if owner is not None:
                self.router.finish(*owner)
                by_replica.setdefault(owner[0], []).append(rid)
        for replica, ids in by_replica.items():
            if self.replicas[replica] is not None:
                try:
                    self.replicas[replica].abort_requests(ids)
                except EngineDeadError as e:
                    self._replica_died(replica, e)

    def has_unfinished(self) -> bool:
        return False

    def get_output(self, interrupt: int | None = None) -> EngineCoreOutputs:
        if self._pending:
            raise self._pending.pop(0)
        self._join_restarted()
        if interrupt is not None:
            self._poller.register(interrupt, zmq.POLLIN)
        try:
            events = dict(self._poller.poll(_POLL_MS))
        finally:
            if interrupt is not None:
                self._poller.unregister(interrupt)
        merged: list = []
        failed: dict[str, str] = {}  # requests that failed alone in their replica's step
        for i, r in enumerate(self.replicas):
            if r is None:
                continue
            out_sock, *sentinel = r.poll_items
            try:
                while out_sock in events or ((merged or failed) and out_sock.poll(0)):
                    events.pop(out_sock, None)
                    out = r.receive()
                    if out is not None:
                        self._account(i, out)
                        merged.extend(out.outputs)
                        failed.update(out.failed)
                if any(x in events for x in sentinel) or r.check_dead():
                    raise r.died()
            except EngineStepError as e:  # one replica's batch failed
                for rid in e.request_ids:
                    owner = self._owner.pop(rid, None)
                    if owner is not None:
                        self.router.finish(*owner)
                self._pending.append(e)
            except EngineDeadError as e:
                self._replica_died(i, e)
        if self._pending and not merged and not failed:
            raise self._pending.pop(0)
        return EngineCoreOutputs(merged, scheduler_stats=self.stats(), failed=failed)

    def _account(self, replica: int, out: EngineCoreOutputs) -> None:
        for rid in out.failed:
            owner = self._owner.pop(rid, None)
            if owner is not None:
                self.router.finish(*owner)
        for o in out.outputs:
            self._generated[replica] += len(o.new_token_ids)
            if o.finish_reason is not None:
                owner = self._owner.pop(o.request_id, None)
                if owner is not None:
                    self.router.finish(*owner)

    def _replica_died(self, replica: int, error: EngineDeadError) -> None:
        client = self.replicas[replica]
        logger.error("replica %d: %s", replica, error.message)
        for item in client.poll_items:
            self._poller.unregister(item)
        last = client.stats()
        for name in _COUNTERS:
            self._retired[name] += getattr(last, name)
        self._retired_received += self._sent[replica]
        self._sent[replica] = 0
        client.shutdown()
        self.replicas[replica] = None
        client.settle_calls("")  # e.g. its share of the KV block map: none
        self.router.set_alive(replica, False)
        failed = [rid for rid, (r, _) in self._owner.items() if r == replica]
        for rid in failed:
            del self._owner[rid]
        if self.restart:
            threading.Thread(target=self._restart, args=(replica,), name=f"tokenmill-restart{replica}",
                             daemon=True).start()
        if all(r is None for r in self.replicas) and not self.restart:
            raise EngineDeadError(f"every replica died; the last: {error.message}")
        if failed:
            self._pending.append(EngineStepError(f"replica {replica} failed: {error.message}", failed))

    def _restart(self, replica: int) -> None:
        try:
            client = self.client_class(self.config, replica=replica)
        except BaseException as e:  # noqa: BLE001 - the replica stays out of the rotation
            logger.error("replica %d could not be restarted: %s", replica, e)
            return
        with self._restart_lock:
            self._restarted.append((replica, client))

    def _join_restarted(self) -> None:
        if not self._restarted:
            return
        with self._restart_lock:
            joined, self._restarted = self._restarted, []
        for replica, client in joined:
            self.replicas[replica] = client
            for item in client.poll_items:
                self._poller.register(item, zmq.POLLIN)
            self.router.set_alive(replica, True)
            logger.info("replica %d restarted", replica)

    def replica_stats(self) -> list[ReplicaStats]:
        empty = SchedulerStats(0, 0, 0.0, 0, 0, 0, 0, 0)
        return [ReplicaStats(i, r is not None, r.stats() if r is not None else empty, self._generated[i])
                for i, r in enumerate(self.replicas)]

    def stats(self) -> SchedulerStats:
        alive = [r.stats() for r in self.replicas if r is not None]
        used, total = sum(s.kv_blocks_used for s in alive), sum(s.kv_blocks_total for s in alive)
        load = SchedulerLoad(*(sum(getattr(s.load, f) for s in alive) for f in SchedulerLoad.__struct_fields__))
        return SchedulerStats(sum(s.num_running for s in alive), sum(s.num_waiting for s in alive),
                              used / total if total else 0.0, used, total,
                              *(self._retired[n] + sum(getattr(s, n) for s in alive) for n in _COUNTERS), load,
                              num_received=self._retired_received + sum(s.num_received for s in alive))

    def call(self, method: str, on_result: Callable) -> None:
        """Ask every live replica; `on_result` gets their results joined (strings concatenated in
        replica order, e.g. the KV block map of all replicas)."""
        live = [(i, r) for i, r in enumerate(self.replicas) if r is not None]
        results: dict[int, object] = {}

        def collect(i, value):
            results[i] = value
            if len(results) == len(live):
                values = [results[j] for j, _ in live]
                on_result("".join(values) if all(isinstance(v, str) for v in values) else values)

        for i, r in live:
            try:
                r.call(method, lambda value, i=i: collect(i, value))
            except EngineDeadError as e:  # its pending calls, this one too, are settled empty
                self._replica_died(i, e)

    def shutdown(self) -> None:
        for r in self.replicas:
            if r is not None:
                r.shutdown()
        with self._restart_lock:
            for _, client in self._restarted:
                client.shutdown()
            self._restarted = []
