"""Callbacks: training-stability control (GradNormBackoff) and monitors (throughput/MFU, memory, communication)."""

from lightning_horizon.callbacks.comm import CommMonitor
from lightning_horizon.callbacks.grad_norm_backoff import BackoffState, GradNormBackoff
from lightning_horizon.callbacks.memory import MemoryMonitor
from lightning_horizon.callbacks.throughput import ThroughputMFUMonitor, fastest_call, measure_matmul_peak

__all__ = ["BackoffState", "CommMonitor", "GradNormBackoff", "MemoryMonitor", "ThroughputMFUMonitor",
           "fastest_call", "measure_matmul_peak"]
