"""Callbacks: training-stability control (GradNormBackoff); monitors (throughput/MFU, memory, comm) come next."""

from lightning_horizon.callbacks.grad_norm_backoff import BackoffState, GradNormBackoff

__all__ = ["BackoffState", "GradNormBackoff"]
