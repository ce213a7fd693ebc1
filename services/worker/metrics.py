"""A worker rank's Prometheus metrics, served on its own port: how long each step's phases take."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, Info

from shared.protocol import StepResult

if TYPE_CHECKING:
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

    def observe(self, result: StepResult) -> None:
        if result.error is None:
            self.forward.observe(result.forward_ms / 1e3)
            self.sample.observe(result.sample_ms / 1e3)
            self.transfer.observe(result.transfer_ms / 1e3)
