"""A worker rank's Prometheus metrics, served on its own port: how long each step's phases take."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, Info

from shared.protocol import StepResult

if TYPE_CHECKING:
    from services.worker.kv_connectors import RemoteConnector
    from services.worker.loader import Numerics

PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class WorkerMetrics:
    def __init__(self, rank: int):
        self.registry = CollectorRegistry()
        phases = Histogram(
            "pagedserve_step_phase_seconds",
            "time of one phase of a step: schedule on the scheduler; forward "
            "(with the step's block transfers), transfer (those alone) and sample here",
            ["phase", "rank"],
            buckets=PHASE_BUCKETS,
            registry=self.registry,
        )
        self.forward = phases.labels("forward", str(rank))
        self.sample = phases.labels("sample", str(rank))
        self.transfer = phases.labels("transfer", str(rank))
        self.compute = Info(
            "pagedserve_worker_compute",
            "how this rank computes: device, the weights' and the "
            "activations' dtypes, and which build of the kernels runs",
            ["rank"],
            registry=self.registry,
        ).labels(str(rank))
        kv_bytes = Counter(
            "pagedserve_kv_transfer_bytes",
            "prefill/decode disaggregation: bytes of KV blocks this rank's server sent to decode engines, and "
            "fetched from prefill engines",
            ["direction", "rank"],
            registry=self.registry,
        )
        self.kv_sent, self.kv_received = kv_bytes.labels("sent", str(rank)), kv_bytes.labels("received", str(rank))
        self.kv_fetch = Histogram(
            "pagedserve_kv_fetch_seconds",
            "prefill/decode disaggregation: one fetch of a prompt's KV blocks, from asking to the last block written",
            ["rank"],
            buckets=PHASE_BUCKETS,
            registry=self.registry,
        ).labels(str(rank))
        self._kv_sent_before = 0

    def describe_compute(self, numerics: Numerics) -> None:
        """`numerics`: the loader's `Numerics` of the model this rank serves."""
        self.compute.info(
            {
                "device": numerics.device,
                "weights": numerics.weights,
                "activations": numerics.activations,
                "kernels": numerics.kernels,
                "quantization": numerics.quantization,
            }
        )

    def observe(self, result: StepResult, remote: RemoteConnector | None = None) -> None:
        if remote is not None:
            for size, seconds in remote.take_fetched():
                self.kv_received.inc(size)
                self.kv_fetch.observe(seconds)
            sent = remote.server.served_bytes if remote.server is not None else 0
            self.kv_sent.inc(sent - self._kv_sent_before)
            self._kv_sent_before = sent
        if result.error is None:
            self.forward.observe(result.forward_ms / 1e3)
            self.sample.observe(result.sample_ms / 1e3)
            self.transfer.observe(result.transfer_ms / 1e3)
