"""The scheduler process: one loop over two sockets, dispatching each message to its handler.

The api's requests arrive on a ROUTER socket; worker ranks connect to a second ROUTER socket. With async scheduling (the
default) two steps are in flight: while the workers compute one, the next is planned ahead and already queued on their
sockets, so they never wait for the scheduler (see `Scheduler` on what is planned ahead). When a result comes back, the
step after next is planned and sent at once, and only then do the outputs go to the api that owns each request.

Each socket hears only its own role's messages, and with CURVE keys admits only its own role's peers
(`shared/wire_security.py`). A rank belongs to the first peer that reports `Ready` for it until that peer leaves; a
connection or departure of any other peer changes nothing. `Shutdown` is not taken from the wire: the scheduler stops on
a signal, or by `stop()` in its own process.

Nothing here waits on a peer. Sends never block: an api that stops reading loses its requests (aborted, blocks freed)
and nobody else notices. A step that gets no result within `step_timeout` counts as a lost worker: its requests end with
an error, the apis answer 503, and the rank is told to reset and report Ready again. An exception while handling one
message fails at most the request it concerns.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from services.scheduler.api_links import ApiLinks
from services.scheduler.assembly import build_scheduler
from services.scheduler.cached_prefixes import CachedPrefixes
from services.scheduler.metrics import SchedulerMetrics, Snapshots
from services.scheduler.results import error_output
from services.scheduler.scheduler import ConfigError, Scheduler
from services.scheduler.stats import Stats
from services.scheduler.stats_log import StatsLog
from shared import sockets
from shared.cli import drain_wakeups, stops_deferred, take_the_stop
from shared.config import Endpoints, LoraConfig, SchedulerConfig
from shared.frame_limits import MAX_FRAME_BYTES
from shared.handshake_budget import HANDSHAKE_EVENTS, HandshakeBudget
from shared.protocol import (
    Abort,
    AddRequest,
    Hello,
    Ping,
    Pong,
    Ready,
    Reset,
    SchedulerInfo,
    Shutdown,
    StepResult,
    Unavailable,
)
from shared.sampling import MAX_SAMPLES
from shared.wire_security import WireKeys, start_authenticator

Handler = Callable[[bytes, Any], None]  # a message type's handler: (sender, message)
log = logging.getLogger(__name__)

API_MESSAGE_CONTAINERS = 20  # an AddRequest holds 4 arrays, and a KVHandoff 2; Abort and Hello fewer
SMALL_WORKER_FRAME = 4096  # a Ready (under 200 bytes); a result from a worker that is not rank 0 is never read


class SchedulerServer:
    def __init__(
        self,
        config: SchedulerConfig,
        endpoints: Endpoints,
        world_size: int = 1,
        keys: WireKeys | None = None,
        max_message_bytes: int = sockets.MAX_MESSAGE_BYTES,
        lora: LoraConfig | None = None,
    ):
        self.config = config
        self.lora = lora or LoraConfig()
        self.world_size = world_size
        self.context = zmq.Context()
        self.authenticator = start_authenticator(self.context, keys)  # before any peer can connect
        # The api sends nothing larger than an AddRequest, and its socket's limit is also what each
        # connection still in its handshake may make this process hold.
        api_frame_limit = min(max_message_bytes, MAX_FRAME_BYTES["AddRequest"] + (64 << 10))
        self.api_socket = sockets.bind(self.context, zmq.ROUTER, endpoints.scheduler, keys, "api", api_frame_limit)
        self.api_socket.setsockopt(zmq.SNDHWM, config.api_send_queue)
        self.worker_socket = sockets.bind(
            self.context, zmq.ROUTER, endpoints.workers, keys, "worker", max_message_bytes
        )
        # Closed connections show here, named by file descriptor: a rank's (its process died)
        # fails its requests at once; any other peer's changes nothing.
        self.closed = {
            self.api_socket.get_monitor_socket(HANDSHAKE_EVENTS): "api",
            self.worker_socket.get_monitor_socket(HANDSHAKE_EVENTS): "worker",
        }
        # On tcp://, connections that have not authenticated yet are bounded (shared/handshake_budget.py).
        self.handshakes = {
            role: HandshakeBudget(role)
            for role, endpoint in (("api", endpoints.scheduler), ("worker", endpoints.workers))
            if endpoint.startswith("tcp://")
        }
        # A StepResult holds per sample a list around its tokens, their logprobs and their alternatives
        # (a list per token); a sequence that verified k proposals has k + 1 tokens.
        k = config.speculative.num_speculative_tokens if config.speculative else 0
        self.worker_message_containers = (7 * MAX_SAMPLES + 2 * k) * config.max_num_seqs + 64
        self.control_endpoint = f"inproc://scheduler-control-{id(self)}"
        self.control = self.context.socket(zmq.PAIR)
        self.control.bind(self.control_endpoint)
        self.rank_connections: dict[int, int] = {}  # rank -> file descriptor of its connection
        self.connection = -1  # the descriptor the message being handled came over
        self.workers: dict[int, bytes] = {}
        self.ready: list[Ready] = []
        self.scheduler: Scheduler | None = None
        self.cached_prefixes: CachedPrefixes | None = None  # with the scheduler
        self.info: SchedulerInfo | None = None
        self.links = ApiLinks(self.api_socket, lambda request_id: self.scheduler and self.scheduler.abort(request_id))
        self.apis, self.owner_of, self.cut_off = self.links.apis, self.links.owner_of, self.links.cut_off  # views
        self.in_flight: deque[tuple[int, bool]] = deque()  # (step id, sent while the workers had work)
        self.depth = 2 if config.async_scheduling else 1
        self.step_deadline = 0.0  # for the oldest step in flight
        self.drain_deadline: float | None = None  # stopping: when the requests still in flight end
        self.worker_busy = self.worker_waiting = 0.0  # seconds, for the idle-time metric
        self.stats_log = StatsLog(config.log_stats_interval)
        self.snapshots = Snapshots(self.context, str(id(self)))  # what a scrape of /metrics reads
        self.metrics = SchedulerMetrics(self.snapshots.fresh)
        self.running, self.exit_code = True, 0
        self.api_handlers: dict[type, Handler] = {
            Hello: self.on_hello,
            AddRequest: self.on_add_request,
            Abort: self.on_abort,
            Ping: self.on_ping,
            Shutdown: self.on_refused_shutdown,
        }
        self.worker_handlers: dict[type, Handler] = {Ready: self.on_ready, StepResult: self.on_step_result}

    def run(self, signals: socket.socket | None = None) -> int:
        """Serve until stopped; `signals`: the socket a signal taken by another thread wakes
        (`shared.cli.stop_on_signals`)."""
        poller = zmq.Poller()
        if signals is not None:
            poller.register(signals, zmq.POLLIN)
        poller.register(self.api_socket, zmq.POLLIN)
        poller.register(self.worker_socket, zmq.POLLIN)
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.snapshots.requests, zmq.POLLIN)
        for monitor in self.closed:
            poller.register(monitor, zmq.POLLIN)
        log.info("scheduler waiting for %d worker rank(s)", self.world_size)
        with stops_deferred():  # a stop comes from `drain_wakeups`, between messages, never amid an update
            try:
                while self.running:
                    self._iterate(poller)
            except KeyboardInterrupt:  # Ctrl-C, or SIGTERM, which __main__ maps to it
                self._finish_in_flight(poller)
        for api in list(self.apis):
            sockets.try_send(self.api_socket, Unavailable("the scheduler is stopping", stopping=True), to=api)
        sockets.stop_monitors([self.api_socket, self.worker_socket], list(self.closed))
        self._stop_workers()
        if self.authenticator is not None:
            self.authenticator.stop()
        self.context.destroy(linger=0)
        return self.exit_code

    def _finish_in_flight(self, poller: zmq.Poller) -> None:
        """Stopping: the requests in flight may finish within --shutdown-timeout, new ones are refused, and those
        left then end with finish_reason "abort"."""
        take_the_stop()
        scheduler, timeout = self.scheduler, self.config.shutdown_timeout
        waits = scheduler is not None and scheduler.has_work() and timeout > 0
        log.info(f"stopping once the requests in flight finish, within {timeout:g} s" if waits else "stopping")
        self.drain_deadline = time.monotonic() + timeout
        with contextlib.suppress(KeyboardInterrupt):  # signals are ignored from here: this one stops the service
            while waits and self.running and self.scheduler is scheduler and time.monotonic() < self.drain_deadline:
                if scheduler is None or not scheduler.has_work():
                    break
                self._iterate(poller)
        if self.scheduler is not None and self.scheduler.requests:
            log.info("ending %d request(s) unfinished at the stop", len(self.scheduler.requests))
            ended = [self.scheduler.abort(request_id) for request_id in list(self.scheduler.requests)]
            self.links.route([output for output in ended if output is not None])

    def _iterate(self, poller: zmq.Poller) -> None:
        self._send_steps()
        for sock, _ in poller.poll(self._poll_timeout_ms()):
            if sock is self.control:
                self.running = False
            elif sock is self.snapshots.requests:
                self.snapshots.take((self.stats(), self.ready[0].device if self.ready else "cpu"))
            elif sock in self.closed:
                self.on_connection_event(recv_monitor_message(sock), self.closed[sock])
            elif sock is self.api_socket:
                self._drain(sock, self.api_handlers, API_MESSAGE_CONTAINERS)
            elif sock is self.worker_socket:
                self._drain_workers()
            else:  # woken for a signal
                drain_wakeups()
        self.links.forget(self.scheduler.kv_cache.remote.expire() if self.scheduler is not None else [])
        if self.scheduler is not None and self.stats_log.due_in() == 0.0:
            self.stats_log.write(self.scheduler.stats())
        if self.in_flight and time.monotonic() > self.step_deadline:
            # The deadline may have passed while this loop was busy (a large request to decode): a
            # result that came meanwhile is the worker's answer in time, so it is read first.
            self._drain_workers()
            if self.in_flight and time.monotonic() > self.step_deadline:
                self.on_worker_lost(
                    f"a worker rank did not finish a step in {self.config.step_timeout:g} s", reset=True
                )

    def stop(self) -> None:
        """Stop the loop from another thread of this process."""
        control = self.context.socket(zmq.PAIR)
        control.connect(self.control_endpoint)
        control.send(b"")
        control.close(linger=1000)

    def stats(self) -> Stats | None:
        if self.scheduler is None:
            return None
        stats = self.scheduler.stats()
        stats.worker_busy_seconds, stats.worker_waiting_seconds = self.worker_busy, self.worker_waiting
        return stats

    def _poll_timeout_ms(self) -> int | None:
        waits = [self.stats_log.due_in(), self.scheduler.kv_cache.remote.due_in() if self.scheduler else None]
        if self.in_flight:
            waits.append(self.step_deadline - time.monotonic())
        if self.drain_deadline is not None:
            waits.append(self.drain_deadline - time.monotonic())
        known = [w for w in waits if w is not None]
        return max(0, int(min(known) * 1000)) + 1 if known else None

    def _drain_workers(self) -> None:
        self._drain(self.worker_socket, self.worker_handlers, self.worker_message_containers, self._admits_worker_frame)

    def _admits_worker_frame(self, sender: bytes, size: int) -> bool:
        """Only rank 0 sends results; any other worker peer sends a `Ready` and nothing large."""
        return sender == self.workers.get(0) or size <= SMALL_WORKER_FRAME

    def _drain(
        self,
        sock: sockets.Socket,
        handlers: dict[type, Handler],
        max_containers: int,
        admit: Callable[[bytes, int], bool] | None = None,
    ) -> None:
        while self.running and sock.poll(0, zmq.POLLIN):
            sender, self.connection, message = sockets.receive_with_connection(sock, max_containers, admit)
            handler = handlers.get(type(message))
            if handler is None:
                if message is not None:
                    log.error("no handler for %s from %r", type(message).__name__, sender)
                continue
            try:
                handler(sender, message)
            except ConfigError as exc:
                log.error("cannot schedule with this configuration: %s", exc)
                self.running, self.exit_code = False, 2
            except Exception:
                log.exception("handling %s from %r failed", type(message).__name__, sender)
                if isinstance(message, AddRequest):
                    self._fail_one(sender, message)
                elif isinstance(message, StepResult):
                    self.on_worker_lost("the scheduler could not apply a step's result", reset=True)

    def _send_steps(self, back_to_back: bool = False) -> None:
        """Plan and send steps until `depth` are in flight or there is nothing to plan."""
        while (scheduler := self.scheduler) is not None and len(self.in_flight) < self.depth:
            if not (scheduler.has_work() or scheduler.kv_cache.has_transfers) or (
                self.in_flight and scheduler.needs_drain
            ):
                # Transfers alone: files to write for blocks cached as the last requests ended.
                return  # with needs_drain, a preemption is due: planned once the steps in flight are done
            try:
                started = time.perf_counter()
                step = scheduler.schedule()
                self.metrics.schedule_seconds.observe(time.perf_counter() - started)
            except Exception:
                log.exception("scheduling failed")
                self.on_worker_lost("the scheduler failed to plan a step", reset=True)
                return
            if step is None:
                return
            self.metrics.tokens_per_step.observe(sum(entry.num_tokens for entry in step.scheduled))
            for waited, tenant, priority in scheduler.queue_times:
                self.metrics.queue_time.labels(tenant, priority).observe(waited)
            scheduler.queue_times.clear()
            for identity in self.workers.values():
                if not sockets.try_send(self.worker_socket, step, to=identity):
                    self.on_worker_lost("a worker rank is not accepting steps", reset=True)
                    return
            if not self.in_flight:
                self.step_deadline = time.monotonic() + self.config.step_timeout
            self.in_flight.append((step.step_id, back_to_back or bool(self.in_flight)))

    # --- api messages --------------------------------------------------------------------

    def on_hello(self, sender: bytes, message: Hello) -> None:
        self.links.know(sender)
        if self.info is not None:
            self.links.send(sender, self.info)

    def on_ping(self, sender: bytes, message: Ping) -> None:
        if sender in self.cut_off:
            self.links.know(sender)
        if self.scheduler is None:
            self.links.send(sender, Pong(message.sent))
        else:
            cached = self.cached_prefixes.report() if self.cached_prefixes is not None else []
            self.links.send(sender, Pong(message.sent, *self.scheduler.load(), cached))

    def on_add_request(self, sender: bytes, message: AddRequest) -> None:
        self.links.know(sender)
        if self.scheduler is None or self.drain_deadline is not None:
            why = "the workers are not ready yet" if self.scheduler is None else "the server is stopping"
            self.links.send_outputs(sender, [error_output(message.request_id, 0, why, "error")])
            return
        error = self.scheduler.add(message)
        if error is not None:
            self.links.send_outputs(sender, [error])
        else:
            self.owner_of[message.request_id] = sender
            if self.cached_prefixes is not None:
                self.cached_prefixes.note(message.prompt_token_ids, message.cache_salt)

    def on_abort(self, sender: bytes, message: Abort) -> None:
        self.links.know(sender)
        if self.scheduler is None:
            return
        for request_id in message.request_ids:
            if self.owner_of.get(request_id) != sender:
                continue  # only the api that sent a request may abort it
            output = self.scheduler.abort(request_id)
            if output is not None:
                self.links.route([output])
            elif self.scheduler.kv_cache.remote.release(request_id):  # a decode engine has its blocks
                self.links.forget([request_id])

    def on_refused_shutdown(self, sender: bytes, message: Shutdown) -> None:
        log.warning("refused a Shutdown from %r: the scheduler stops on a signal, not by message", sender)

    def _fail_one(self, sender: bytes, message: AddRequest) -> None:
        if self.scheduler is not None and message.request_id in self.scheduler.requests:
            self.scheduler.abort(message.request_id)
        self.owner_of.pop(message.request_id, None)
        self.links.send_outputs(
            sender, [error_output(message.request_id, 0, "the scheduler could not take this request", "error")]
        )

    # --- worker messages -----------------------------------------------------------------

    def on_ready(self, sender: bytes, message: Ready) -> None:
        holder = self.workers.get(message.rank)
        if holder is not None and holder != sender:
            log.warning("refused Ready for rank %d from %r: the rank is held by %r", message.rank, sender, holder)
            return
        if not 0 <= message.rank < self.world_size or message.world_size != self.world_size:
            runs = f"this scheduler runs {self.world_size} rank(s)"
            log.warning(f"refused Ready for rank {message.rank} of {message.world_size} from {sender!r}: {runs}")
            return
        if sender in self.workers.values() and holder != sender:
            log.warning("refused Ready for rank %d from %r: that peer holds another rank", message.rank, sender)
            return
        log.info("worker rank %d ready with %d KV blocks on its device", message.rank, message.num_gpu_blocks)
        self.workers[message.rank] = sender
        self.rank_connections[message.rank] = self.connection
        self.ready = [r for r in self.ready if r.rank != message.rank] + [message]
        if len(self.workers) == self.world_size and self.scheduler is None:
            self._start_scheduling()

    def _start_scheduling(self) -> None:
        self.scheduler, self.info = build_scheduler(self.config, self.lora, self.ready, self.world_size)
        self.cached_prefixes = CachedPrefixes(self.scheduler.kv_cache, self.config.block_size)
        for api in list(self.apis):
            self.links.send(api, self.info)

    def on_connection_event(self, event: dict[str, Any], role: str) -> None:
        budget = self.handshakes.get(role)
        if budget is not None:
            budget.on_event(event["event"], event["value"])
        if event["event"] == zmq.EVENT_DISCONNECTED:
            self.on_connection_closed(event["value"], role)

    def on_connection_closed(self, descriptor: int, role: str) -> None:
        if role == "worker" and descriptor in self.rank_connections.values():
            self.on_worker_lost("a worker rank disconnected")
        else:  # libzmq drops the connection of a peer whose frame is over the limit, silently
            sockets.peer_log.info(
                "a connection to the %s socket closed (its peer stopped, failed the handshake, "
                "or sent a frame over --max-message-bytes)",
                role,
            )

    def on_worker_lost(self, reason: str, reset: bool = False) -> None:
        """End every request with an error, tell the apis, and wait for the ranks to report again."""
        if not self.workers:
            return
        if self.scheduler is not None and self.scheduler.has_work():
            log.error("%s; failing every request and waiting for the ranks again", reason)
        else:  # a clean stop, or a restart while idle: no request failed
            log.info("%s; waiting for the ranks again", reason)
        if self.scheduler is not None:
            self.links.route(self.scheduler.fail_all(reason))
        if reset:  # the rank may still be alive (hung, or slow): have it start over
            for identity in self.workers.values():
                sockets.try_send(self.worker_socket, Reset(), to=identity)
        self.scheduler, self.info = None, None
        self.in_flight.clear()
        self.workers.clear()
        self.rank_connections.clear()
        self.ready.clear()
        for api in list(self.apis):
            self.links.send(api, Unavailable(reason))

    def on_step_result(self, sender: bytes, message: StepResult) -> None:
        if sender != self.workers.get(0):
            log.warning("ignored a result for step %d from %r, which is not rank 0", message.step_id, sender)
            return
        if not self.in_flight or message.step_id != self.in_flight[0][0] or self.scheduler is None:
            # A worker's connection outlives a scheduler restart, and a step that timed out may
            # still finish: such a result belongs to no step of ours.
            log.warning("ignored a result for step %d, which is not in flight", message.step_id)
            return
        _, had_work = self.in_flight.popleft()
        self.step_deadline = time.monotonic() + self.config.step_timeout  # the next one starts now
        if message.error is not None:
            log.error("step %d failed on the worker: %s", message.step_id, message.error)
            self.in_flight.clear()  # a step after it finds its sequences gone; its result is ignored
            self.links.route(self.scheduler.recover(message.step_id, message.error, message.culprits))
            if self.scheduler.failures.worker_at_fault:  # every request has ended
                self._stop_workers(restart=True)
                self.on_worker_lost("the worker failed step after step on no request's inputs; it restarts")
            else:
                self._send_steps(back_to_back=True)
            return
        self.worker_busy += (message.forward_ms + message.sample_ms) / 1e3
        self.stats_log.count(sum(len(s.token_ids) for s in message.sampled))
        if had_work:  # the worker waited on us, not on work to arrive
            self.worker_waiting += message.idle_ms / 1e3
        outputs = self.scheduler.update(message, message.idle_ms if had_work else 0.0)
        self._send_steps(back_to_back=True)  # the worker computes the next step while the apis stream this one
        self.links.route(outputs)

    def _stop_workers(self, restart: bool = False) -> None:
        for identity in self.workers.values():
            sockets.try_send(self.worker_socket, Shutdown(restart), to=identity)
        time.sleep(0.05)
