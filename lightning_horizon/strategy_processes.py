"""DDPStrategy's processes on CPU machines: HorizonStrategy's base, what every rank's process is before any part.

A backend chosen for the CPU (``ccl`` where oneCCL's binding imports, else gloo), each local rank pinned to its
cores with its thread pool sized to them, the node topology and its process groups (placement.py), a timeout that
ends a job whose peer is gone, a heartbeat that ends one whose peer hangs (heartbeat.py), one process reducing
without a collective; and at teardown the threads, affinity and allocator of before. The options it reads are
``options.process`` (process_config.py).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import Strategy
from typing_extensions import override

from lightning_horizon import cpu, heartbeat, liveness, placement
from lightning_horizon.options import HorizonOptions
from lightning_horizon.process_config import ccl_available
from lightning_horizon.topology import ProcessGroups, Topology
from lightning_horizon.unused import explain_unused


class CPUProcessesStrategy(DDPStrategy):
    """The processes, cores and links of HorizonStrategy (module docstring); ``options``: its checked options."""

    def __init__(self, options: HorizonOptions, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.options = options
        self.topology: Optional[Topology] = None
        self.process_groups: Optional[ProcessGroups] = None
        #: per-rank facts gathered at setup (rank, node, local rank, cores, threads, shared): the startup table
        self.placement: list[dict[str, Any]] = []
        #: this rank's heartbeat while a stage runs (heartbeat.py), ``None`` without; the hooks beat it
        self.heartbeat: Optional[heartbeat.Heartbeat] = None
        self._reported = False
        self._thread_settings: Optional[cpu.ThreadSettings] = None

    @override
    def _configure_launcher(self) -> None:
        self.options.check_world(self.num_nodes * self.num_processes, self.num_processes, self.root_device)
        # teardown gives back the threads, affinity and OpenMP variables of before (a notebook goes on after fit)
        self._thread_settings = cpu.ThreadSettings.capture()
        process = self.options.process
        if process.pin_cores and self.root_device.type == "cpu":
            # the count pinning gives rank 0, for Lightning's launcher: with OMP_NUM_THREADS set it leaves
            # torch.set_num_threads alone (a call costs even where the count is unchanged: cpu.set_threads), and the
            # ranks it starts begin with it
            os.environ.setdefault("OMP_NUM_THREADS",
                                  str(cpu.planned_threads(0, self.num_processes, process.threads_per_rank)))
        super()._configure_launcher()

    @override
    def _get_process_group_backend(self) -> str:
        if self._process_group_backend or self.root_device.type != "cpu":
            return super()._get_process_group_backend()
        return "ccl" if ccl_available() else "gloo"

    @override
    def setup_distributed(self) -> None:
        # one process too, as DDPStrategy: a DistributedSampler or torch.distributed call works unchanged; under
        # torchrun's agent store on a store of this restart attempt's own (placement.init_process_group)
        self.set_world_ranks()
        placement.init_process_group(self.cluster_environment.main_address, self.cluster_environment.main_port,
                                     self._get_process_group_backend(), self.global_rank, self.world_size,
                                     self._timeout)
        super().setup_distributed()
        placement.destroy_process_group_at_exit()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        report = self.global_rank == 0 and not self._reported  # once per strategy: validate/test/predict again
        self.topology, self.process_groups, self.placement = placement.start(
            self.options, self.world_size, self.global_rank, self.local_rank, self.num_processes, self.root_device,
            self._process_group_backend, report)
        self._reported = self._reported or report
        self._stop_heartbeat()  # a stage that ended without its teardown
        timeout = self.options.process.heartbeat_timeout
        if self.world_size > 1 and timeout is not None:
            self.heartbeat = heartbeat.start(self.cluster_environment.main_address,
                                             self.cluster_environment.main_port, self.global_rank, self.placement,
                                             timeout)

    def _stop_heartbeat(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        # one process: the value itself, as SingleDeviceStrategy (an all-reduce over one rank costs ~0.2 ms a call)
        return tensor if self.world_size == 1 else super().reduce(tensor, group=group, reduce_op=reduce_op)

    def startup_table(self) -> str:
        """Topology, per-rank cores and threads, ISA, backend and allocator, as printed at fit start (after setup)."""
        return placement.startup_table(self.topology, self.placement, self._process_group_backend)

    @override
    def on_exception(self, exception: BaseException) -> None:
        Strategy.on_exception(self, exception)
        explain_unused(exception)  # DDPStrategy's explanation of the reducer's error, naming this strategy's switch
        liveness.name_lost_peer(exception, self.placement, self.global_rank, self._timeout.total_seconds())

    @override
    @heartbeat.beats("validation_step")
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return super().validation_step(*args, **kwargs)

    @override
    @heartbeat.beats("test_step")
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return super().test_step(*args, **kwargs)

    @override
    @heartbeat.beats("predict_step")
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return super().predict_step(*args, **kwargs)

    @override
    def teardown(self) -> None:
        self._stop_heartbeat()
        super().teardown()
        if self._thread_settings is not None:
            self._thread_settings.restore()
        if self.placement and self.placement[self.global_rank]["keeps_freed_memory"]:
            cpu.release_freed_memory()  # glibc's own thresholds again, the kept memory handed back

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # DDPStrategy's names: "horizon", "horizon_spawn", "horizon_fork", each also with
        # "_find_unused_parameters_true"; registering twice (the package imported again) is harmless
        for name, start_method in (("horizon", "popen"), ("horizon_spawn", "spawn"), ("horizon_fork", "fork")):
            for suffix, unused in (("", False), ("_find_unused_parameters_true", True)):
                if f"{name}{suffix}" not in strategy_registry:
                    strategy_registry.register(
                        f"{name}{suffix}", cls, start_method=start_method,
                        description=f"{cls.__name__} with start_method={start_method!r}"
                        f"{', find_unused_parameters=True' if unused else ''}",
                        **({"find_unused_parameters": True} if unused else {}))


__all__ = ["CPUProcessesStrategy"]
