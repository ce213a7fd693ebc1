"""The scheduler process: one loop over two sockets, dispatching each message to its handler.

The api's requests arrive on a ROUTER socket; worker ranks connect to a second ROUTER socket.
At most one step is in flight: when its result comes back, the outputs go to the api that owns
each request and the next step is scheduled at once.
"""

from __future__ import annotations

import logging
import time

import zmq

from services.scheduler.block_manager import BlockManager
from services.scheduler.scheduler import Budgets, PreemptionPolicy, Scheduler
from shared import sockets
from shared.config import Endpoints, SchedulerConfig
from shared.protocol import (
    Abort,
    AddRequest,
    GetStats,
    Hello,
    Ready,
    RequestOutput,
    RequestOutputs,
    SchedulerInfo,
    Shutdown,
    StepResult,
)

log = logging.getLogger(__name__)


class SchedulerServer:
    def __init__(self, config: SchedulerConfig, endpoints: Endpoints, world_size: int = 1):
        self.config = config
        self.world_size = world_size
        self.context = zmq.Context()
        self.api_socket = sockets.bind(self.context, zmq.ROUTER, endpoints.scheduler)
        self.worker_socket = sockets.bind(self.context, zmq.ROUTER, endpoints.workers)
        self.workers: dict[int, bytes] = {}
        self.ready: list[Ready] = []
        self.scheduler: Scheduler | None = None
        self.info: SchedulerInfo | None = None
        self.waiting_hellos: list[bytes] = []
        self.owner_of: dict[str, bytes] = {}
        self.step_in_flight: int | None = None  # the id of the step the workers are executing
        self.running = True
        self.api_handlers = {
            Hello: self.on_hello,
            AddRequest: self.on_add_request,
            Abort: self.on_abort,
            GetStats: self.on_get_stats,
            Shutdown: self.on_shutdown,
        }
        self.worker_handlers = {Ready: self.on_ready, StepResult: self.on_step_result}

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.api_socket, zmq.POLLIN)
        poller.register(self.worker_socket, zmq.POLLIN)
        # A worker's connection closing (its process died) shows here, so no request waits forever.
        worker_events = self.worker_socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller.register(worker_events, zmq.POLLIN)
        log.info("scheduler waiting for %d worker rank(s)", self.world_size)
        while self.running:
            self._maybe_send_step()
            for sock, _ in poller.poll():
                if sock is worker_events:
                    worker_events.recv_multipart()
                    self.on_worker_lost()
                    continue
                handlers = self.api_handlers if sock is self.api_socket else self.worker_handlers
                self._drain(sock, handlers)
        self.worker_socket.disable_monitor()
        self._stop_workers()
        self.context.destroy(linger=0)

    def _drain(self, sock: zmq.Socket, handlers: dict) -> None:
        while sock.poll(0, zmq.POLLIN):
            sender, message = sockets.receive(sock, routed=True)
            handler = handlers.get(type(message))
            if handler is None:
                if message is not None:
                    log.error("no handler for %s from %r", type(message).__name__, sender)
                continue
            handler(sender, message)

    def _maybe_send_step(self) -> None:
        if self.scheduler is None or self.step_in_flight is not None or not self.scheduler.has_work():
            return
        step = self.scheduler.schedule()
        if step is None:
            return
        for identity in self.workers.values():
            sockets.send(self.worker_socket, step, to=identity)
        self.step_in_flight = step.step_id

    # --- api messages --------------------------------------------------------------------

    def on_hello(self, sender: bytes, message: Hello) -> None:
        if self.info is None:
            self.waiting_hellos.append(sender)
        else:
            sockets.send(self.api_socket, self.info, to=sender)

    def on_add_request(self, sender: bytes, message: AddRequest) -> None:
        if self.scheduler is None:
            self._send_outputs(
                sender,
                [RequestOutput(message.request_id, 0, [], True, "the workers are not ready yet")],
            )
            return
        error = self.scheduler.add(message)
        if error is not None:
            self._send_outputs(sender, [error])
        else:
            self.owner_of[message.request_id] = sender

    def on_abort(self, sender: bytes, message: Abort) -> None:
        if self.scheduler is None:
            return
        for request_id in message.request_ids:
            output = self.scheduler.abort(request_id)
            if output is not None:
                self._route([output])

    def on_get_stats(self, sender: bytes, message: GetStats) -> None:
        if self.scheduler is not None:
            sockets.send(self.api_socket, self.scheduler.stats(), to=sender)

    def on_shutdown(self, sender: bytes, message: Shutdown) -> None:
        self.running = False

    # --- worker messages -----------------------------------------------------------------

    def on_ready(self, sender: bytes, message: Ready) -> None:
        log.info("worker rank %d ready with %d GPU blocks", message.rank, message.num_gpu_blocks)
        self.workers[message.rank] = sender
        self.ready.append(message)
        if len(self.workers) == self.world_size and self.scheduler is None:
            self._start_scheduling()

    def _start_scheduling(self) -> None:
        first = self.ready[0]
        if first.block_size != self.config.block_size:
            raise RuntimeError(
                f"worker block size {first.block_size} != scheduler's {self.config.block_size}"
            )
        config = self.config
        num_blocks = config.num_gpu_blocks_override or min(r.num_gpu_blocks for r in self.ready)
        num_cpu_blocks = min(r.num_cpu_blocks for r in self.ready)
        block_manager = BlockManager(
            num_blocks, config.block_size, num_cpu_blocks, config.watermark, config.enable_prefix_caching
        )
        usable_tokens = (num_blocks - block_manager.watermark_blocks) * config.block_size
        max_model_len = min(config.max_model_len or first.max_model_len, usable_tokens)
        default_batched = 2048 if config.enable_chunked_prefill else max(max_model_len, 2048)
        max_batched = config.max_num_batched_tokens or default_batched
        budgets = Budgets(config.max_num_seqs, max_batched, max_model_len, config.enable_chunked_prefill)
        preemption = PreemptionPolicy(
            config.preemption_mode, first.block_bytes, first.swap_bytes_per_second,
            first.prefill_tokens_per_second,
        )
        self.scheduler = Scheduler(block_manager, budgets, first.eos_token_ids, preemption)
        self.info = SchedulerInfo(config.block_size, num_blocks, max_model_len, max_batched, first.eos_token_ids)
        log.info("scheduling with %d GPU blocks, context %d tokens", num_blocks, max_model_len)
        for api in self.waiting_hellos:
            sockets.send(self.api_socket, self.info, to=api)
        self.waiting_hellos.clear()

    def on_worker_lost(self) -> None:
        """End every request with an error and wait for the ranks to come back (a restart)."""
        if not self.workers:
            return
        log.error("a worker rank disconnected; failing every request and waiting for the ranks again")
        if self.scheduler is not None:
            self._route(self.scheduler.fail_all("a worker rank disconnected"))
        self.scheduler, self.info, self.step_in_flight = None, None, None
        self.workers.clear()
        self.ready.clear()

    def on_step_result(self, sender: bytes, message: StepResult) -> None:
        if message.step_id != self.step_in_flight:
            # A worker's connection outlives a scheduler restart, so a result queued for the
            # old scheduler can arrive here first; it belongs to no step of ours.
            log.warning("ignored a result for step %d, which is not in flight", message.step_id)
            return
        self.step_in_flight = None
        if message.error is not None:
            log.error("step %d failed on the worker: %s", message.step_id, message.error)
            self._route(self.scheduler.fail_all(f"the worker failed: {message.error}"))
            return
        self._route(self.scheduler.update(message))

    # --- helpers -------------------------------------------------------------------------

    def _route(self, outputs: list[RequestOutput]) -> None:
        by_owner: dict[bytes, list[RequestOutput]] = {}
        for output in outputs:
            owner = self.owner_of.get(output.request_id)
            if owner is None:
                continue
            by_owner.setdefault(owner, []).append(output)
            if output.finished:
                del self.owner_of[output.request_id]
        for owner, batch in by_owner.items():
            self._send_outputs(owner, batch)

    def _send_outputs(self, owner: bytes, outputs: list[RequestOutput]) -> None:
        try:
            sockets.send(self.api_socket, RequestOutputs(outputs), to=owner)
        except zmq.ZMQError as exc:  # the api went away; its requests are aborted below
            log.warning("api %r unreachable (%s); aborting its requests", owner, exc)
            for output in outputs:
                if not output.finished and self.scheduler is not None:
                    self.scheduler.abort(output.request_id)
                self.owner_of.pop(output.request_id, None)

    def _stop_workers(self) -> None:
        for identity in self.workers.values():
            try:
                sockets.send(self.worker_socket, Shutdown(), to=identity)
            except zmq.ZMQError:
                pass
        time.sleep(0.05)
