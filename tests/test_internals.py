"""Pins every private Lightning / torch internal the package still relies on (docs/architecture.md lists each
with its reason). An upgrade that renames or reshapes one fails here, by name, instead of somewhere deep in a fit.
"""

import inspect
import os

import torch
import torch.distributed as dist


def test_optimizer_step_hook_dicts():
    """Kahan's chunks and the store's layers (optim.step_in_parts) run the step pre-/post-hooks once per
    training step by swapping these dicts."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    assert len(opt._optimizer_step_pre_hooks) == 1 and len(opt._optimizer_step_post_hooks) == 1
    saved = opt._optimizer_step_pre_hooks
    opt._optimizer_step_pre_hooks = type(saved)()
    opt.step()
    opt._optimizer_step_pre_hooks = saved
    assert calls == ["post"]


def test_graph_task_id_tells_a_recompute_inside_backward():
    """The out-of-core store reads ahead the unit before a recomputed one: a forward inside backward is a recompute."""
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(torch._C._current_graph_task_id())
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(torch._C._current_graph_task_id())
            return g * 2

    Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert seen[0] == -1 and seen[1] != -1


def test_scheduler_marks_its_step_wrapper():
    """The store's layer-by-layer step replaces ``optimizer.step`` after a scheduler wrapped it: it keeps the mark
    the scheduler checks (else torch warns that ``step`` was overridden) and calls the wrapper, which counts."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, 1)
    assert hasattr(opt.step, "_wrapped_by_lr_sched") and "step" in opt.__dict__


def test_module_parameters_dict_swap_keeps_state_dict_keys():
    """fp32 compute of bf16 weights swaps ``module._parameters[name]`` for a differentiable fp32 copy."""
    lin = torch.nn.Linear(2, 2).to(torch.bfloat16)
    params = dict(lin._parameters)
    for name, p in params.items():
        lin._parameters[name] = p.float()
    out = lin(torch.ones(1, 2))
    assert out.dtype == torch.float32 and list(lin.state_dict()) == ["weight", "bias"]
    lin._parameters.update(params)
    out.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in lin.parameters())


def test_fake_tensor_and_dispatch_internals_of_the_sharding_profile():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    assert inspect.isclass(TorchDispatchMode) and "allow_non_fake_inputs" in inspect.signature(FakeTensorMode).parameters
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert isinstance(torch.zeros(2), FakeTensor)
        with _disable_current_modes():  # a real copy made inside the fake profile
            assert not isinstance(torch.zeros(2), FakeTensor)
    aten = torch.ops.aten
    assert aten._local_scalar_dense.default._schema.name == "aten::_local_scalar_dense"
    assert aten.add_.Tensor._schema.is_mutable and not aten.add.Tensor._schema.is_mutable
    assert {aten._unique.default.name(), aten._unique2.default.name()} == {"aten::_unique", "aten::_unique2"}
    # storages and generators compared by identity
    t = torch.zeros(2)
    assert t.untyped_storage()._cdata == t[1:].untyped_storage()._cdata
    assert isinstance(torch.default_generator._cdata, int)
    assert torch.Generator()._cdata != torch.default_generator._cdata
    m = torch.nn.BatchNorm1d(2)
    m.register_buffer("mask", None)
    m.register_buffer("cache", torch.zeros(1), persistent=False)
    assert m._buffers["mask"] is None and "mask" in m._buffers and m._non_persistent_buffers_set == {"cache"}


def test_distributed_is_available():
    assert dist.is_available()


def test_will_engine_execute_node_tells_which_parameters_get_a_gradient():
    """The store counts, per backward, only the parameters whose AccumulateGrad node this backward runs."""
    from torch.autograd.graph import get_gradient_edge

    used, unused = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    seen = {}

    def hook(_):
        seen["used"] = torch._C._will_engine_execute_node(get_gradient_edge(used).node)
        seen["unused"] = torch._C._will_engine_execute_node(get_gradient_edge(unused).node)

    unused.sum()  # an AccumulateGrad node exists, outside this backward's graph
    y = used * 2
    y.register_hook(hook)
    y.sum().backward()
    assert seen == {"used": True, "unused": False}


# ---------------------------------------------------------------------------------------- Lightning's DDPStrategy


def test_ddp_strategy_keeps_its_arguments_under_private_names():
    """HorizonStrategy reads what DDPStrategy was given: the DDP kwargs (``find_unused_parameters``), the user's comm
    hook, state and wrapper (registered by us, Lightning drops them on CPU), the backend and the collective timeout."""
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    hook, state, wrapper = (lambda s, b: None), object(), (lambda h: h)
    s = DDPStrategy(ddp_comm_hook=hook, ddp_comm_state=state, ddp_comm_wrapper=wrapper, process_group_backend="gloo",
                    timeout=timedelta(seconds=7), find_unused_parameters=True)
    assert s._ddp_comm_hook is hook and s._ddp_comm_state is state and s._ddp_comm_wrapper is wrapper
    assert s._ddp_kwargs == {"find_unused_parameters": True}
    assert s._timeout == timedelta(seconds=7)
    assert s._process_group_backend == "gloo" == s.process_group_backend


def test_ddp_strategy_calls_the_private_hooks_we_override():
    """HorizonStrategy overrides ``_configure_launcher`` (Trainer construction: checks before any process starts),
    ``_setup_model`` then ``_register_ddp_hooks`` (``configure_ddp``: no DDP wrapper on one process or when
    node-sharded, our comm hooks on CPU) and ``_get_process_group_backend`` (``setup_distributed`` stores its answer
    in ``_process_group_backend``, read for the startup table)."""
    from datetime import timedelta

    import lightning as L
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.strategies import DDPStrategy

    calls = []

    class Recording(DDPStrategy):
        def _configure_launcher(self):
            calls.append("launcher")
            super()._configure_launcher()

        def _setup_model(self, model):
            calls.append("setup_model")
            return model

        def _register_ddp_hooks(self):
            calls.append("ddp_hooks")

        def _get_process_group_backend(self):
            calls.append("backend")
            return "gloo"

    L.Trainer(accelerator="cpu", devices=1, strategy=Recording(), logger=False, enable_checkpointing=False,
              enable_model_summary=False, enable_progress_bar=False)
    assert calls == ["launcher"]
    s, model = Recording(), BoringModel()
    s.model = model
    s.configure_ddp()
    assert calls == ["launcher", "setup_model", "ddp_hooks"] and s.model is model
    # a world of one in this process (destroyed by conftest): Lightning's own init then keeps it
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30))
    s = Recording(cluster_environment=LightningEnvironment(), parallel_devices=[torch.device("cpu")])
    s.setup_distributed()
    assert calls[-1] == "backend" and s._process_group_backend == "gloo"


def test_augment_message_rewrites_the_reducer_error():
    """``on_exception`` names our ``find_unused_parameters`` switch in DDP's reducer error, as DDPStrategy does."""
    from lightning_horizon.strategy import HorizonStrategy
    from lightning_horizon.unused import UNUSED_PARAMETERS

    err = RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one.", 3)
    HorizonStrategy().on_exception(err)  # explain_unused: Lightning's _augment_message
    assert err.args == (UNUSED_PARAMETERS, 3)
    other = RuntimeError("something else", 3)
    HorizonStrategy().on_exception(other)
    assert other.args == ("something else", 3)


# ---------------------------------------------------------------------------------------- Lightning, other parts


def test_precision_after_closure_runs_the_step_callbacks_and_clipping():
    """HorizonPrecision overrides ``Precision._after_closure`` to measure the fp32 norm after backward and before
    the callbacks; Lightning calls it from ``optimizer_step`` after the closure, and its own one runs
    ``on_before_optimizer_step`` and the Trainer's ``gradient_clip_val``."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.plugins.precision import Precision

    calls = []

    class Hook(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            calls.append("on_before_optimizer_step")

    class Recording(Precision):
        def _after_closure(self, model, optimizer):
            calls.append("after_closure")
            super()._after_closure(model, optimizer)

    trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[Hook()], gradient_clip_val=1e-3, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    model, precision = BoringModel(), Recording()
    model.trainer = trainer
    trainer.strategy.connect(model)
    trainer.strategy.precision_plugin = precision
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model(torch.ones(2, 32)).sum().mul(1e3).backward()
    precision.optimizer_step(opt, model, lambda: calls.append("closure"))
    assert calls == ["closure", "after_closure", "on_before_optimizer_step"]
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert torch.allclose(norm, torch.tensor(1e-3))


def test_every_clip_looks_up_clip_gradients_on_the_plugin_instance():
    """The parts registry routes every clip by setting ``clip_gradients`` on the precision plugin instance (parts.py):
    Trainer's ``gradient_clip_val`` (``Precision._clip_gradients`` -> ``configure_gradient_clipping``) and
    ``self.clip_gradients`` must both end in that instance attribute."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.utilities import GradClipAlgorithmType

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    model, seen = BoringModel(), []
    trainer.strategy.connect(model)
    model.trainer = trainer
    p = trainer.precision_plugin
    p.clip_gradients = lambda opt, val, algorithm: seen.append((val, algorithm.value))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p._clip_gradients(model, opt, 0.5, GradClipAlgorithmType.NORM)  # the Trainer's gradient_clip_val
    model.clip_gradients(opt, gradient_clip_val=0.25, gradient_clip_algorithm="value")
    assert seen == [(0.5, "norm"), (0.25, "value")]


def test_lightning_module_trainer_attribute():
    """The strategy, its checkpoint part and the sharder (plain modules too) ask ``module._trainer``: ``None`` while
    detached, where the public ``trainer`` property raises."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    model = BoringModel()
    assert model._trainer is None
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, enable_progress_bar=False)
    model.trainer = trainer
    assert model._trainer is trainer


def test_callback_state_key_format():
    """GradNormBackoff's ``state_key`` is ``Callback._generate_state_key``: checkpoints saved with it keep their key."""
    import lightning as L

    class Backoff(L.Callback):
        pass

    key = Backoff()._generate_state_key(max_norm=1.0)
    assert key == "test_callback_state_key_format.<locals>.Backoff{'max_norm': 1.0}"


def test_progress_bar_metrics_is_the_dict_the_bar_shows():
    """ThroughputMFUMonitor writes ``tok/s`` as a string of digits into ``trainer.progress_bar_metrics``: the bar
    shows it as it is (tqdm would print the number 20000 as 2e+4, its shorter form)."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel
    from tqdm import tqdm

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_model_summary=False)
    trainer.progress_bar_metrics["tok/s"] = "20000"
    shown = trainer.progress_bar_callback.get_metrics(trainer, BoringModel())
    assert shown["tok/s"] == "20000"
    with tqdm(total=1, disable=False, file=open(os.devnull, "w")) as bar:
        bar.set_postfix(shown)
        assert "tok/s=20000" in bar.postfix
        bar.set_postfix({"tok/s": 20000})
        assert "tok/s=2e+4" in bar.postfix  # what a number would show


# ---------------------------------------------------------------------------------------- torch


def test_global_optimizer_step_hook_dicts():
    """The store refuses to step in backward when a global step pre-hook exists, and a step in parts (optim.py) lets
    the global hooks fire once: torch keeps them in these dicts, read at every step."""
    from torch.optim import optimizer as o

    for hooks, register in ((o._global_optimizer_pre_hooks, o.register_optimizer_step_pre_hook),
                            (o._global_optimizer_post_hooks, o.register_optimizer_step_post_hook)):
        before = len(hooks)
        calls = []
        handle = register(lambda *a: calls.append(1))
        assert len(hooks) == before + 1
        saved = dict(hooks)
        hooks.clear()  # emptied in place, as step_in_parts does between the first and the last part
        p = torch.nn.Parameter(torch.ones(1))
        p.grad = torch.ones(1)
        torch.optim.SGD([p], lr=0.1).step()
        assert calls == []
        hooks.update(saved)
        torch.optim.SGD([p], lr=0.1).step()
        assert calls == [1]
        handle.remove()
        assert len(hooks) == before


def test_optimizer_hook_dicts_a_copy_starts_afresh():
    """memory/optimizer_state.py copies an optimizer without its hooks: every hook dict torch keeps on an instance is
    named in the list it leaves out, and ``__setstate__`` makes each anew."""
    from lightning_horizon.memory.optimizer_state import _FRESH

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    hook_dicts = {k for k, v in vars(opt).items() if k.endswith("_hooks") and isinstance(v, dict)}
    assert len(hook_dicts) == 6 and hook_dicts <= set(_FRESH)
    clone = torch.optim.SGD.__new__(torch.optim.SGD)
    clone.__setstate__({"defaults": opt.defaults, "state": {}, "param_groups": opt.param_groups})
    assert all(getattr(clone, k) == {} for k in hook_dicts)


def test_tensor_backward_hooks_attribute():
    """wire.py leaves a tensor with hooks to pickle: ``register_hook`` keeps them in ``Tensor._backward_hooks``."""
    t = torch.zeros(2, requires_grad=True)
    assert not t._backward_hooks
    t.register_hook(lambda g: g)
    assert len(t._backward_hooks) == 1


def test_ddp_reducer_rebuilds_its_buckets_after_the_first_backward():
    """The bucket layout saved for exact restarts (collectives/sync.py): after the first backward
    ``Reducer._rebuild_buckets()`` rebuilds (True, then False), and ``_get_zeros_like_grad_buckets()`` gives the
    rebuilt buckets, whose buffers hold every gradient."""
    from datetime import timedelta

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    ddp(torch.ones(3, 4)).sum().backward()
    assert ddp.reducer._rebuild_buckets() is True and ddp.reducer._rebuild_buckets() is False
    sizes = [b.buffer().numel() for b in ddp.reducer._get_zeros_like_grad_buckets()]
    assert len(sizes) > 1 and sum(sizes) == sum(p.numel() for p in model.parameters())


def test_activation_checkpoint_wrapper_of_the_sharding_benchmark():
    """recipes/bench_sharding.py compares with torch's per-block wrapper: each block becomes a wrapper module whose
    parameter names carry its prefix (why the sharder patches ``forward`` instead)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    wrap = lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT)  # noqa: E731
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrap, check_fn=lambda m: isinstance(m, torch.nn.Linear))
    assert type(model[0]).__name__ == "CheckpointWrapper"
    assert [n for n, _ in model.named_parameters()] == ["0._checkpoint_wrapped_module.weight",
                                                         "0._checkpoint_wrapped_module.bias"]


def test_foreach_norm_and_mul_match_one_op_per_tensor():
    """gradnorm.py: one foreach op over all gradients gives each gradient's norm in the accumulation dtype (bf16
    gradients in fp32), bit for bit ``linalg.vector_norm``'s, and a clip equal to one ``mul_`` per gradient."""
    torch.manual_seed(0)
    grads = [torch.randn(n) * s for n, s in ((7, 1e-8), (1000, 1.0), (4096, 1e3))]
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        gs = [g.to(dtype) for g in grads]
        acc = torch.promote_types(torch.float32, dtype)
        for ord in (2.0, 1.0, float("inf")):
            got = torch._foreach_norm(gs, ord, dtype=acc)
            assert all(torch.equal(a, torch.linalg.vector_norm(g, ord, dtype=acc)) for a, g in zip(got, gs))
        coef = torch.tensor(0.3).to(dtype)
        ones = [g.clone() for g in gs]
        torch._foreach_mul_(ones, coef)
        assert all(torch.equal(a, g * coef) for a, g in zip(ones, gs))
