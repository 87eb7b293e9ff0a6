"""Pins every private Lightning / torch internal the package still relies on (docs/architecture.md lists each
with its reason). An upgrade that renames or reshapes one fails here, by name, instead of somewhere deep in a fit.
"""

import inspect

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


def test_ddp_reducer_bucket_rebuild_calls():
    """The bucket layout saved for exact restarts reads DDP's reducer: ``_rebuild_buckets`` and
    ``_get_zeros_like_grad_buckets``."""
    reducer = torch._C._distributed_c10d.Reducer
    assert callable(getattr(reducer, "_rebuild_buckets")) and callable(getattr(reducer, "_get_zeros_like_grad_buckets"))


def test_fake_tensor_and_dispatch_internals_of_the_sharding_profile():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    assert issubclass(FakeTensor, torch.Tensor) and callable(_disable_current_modes)
    assert inspect.isclass(TorchDispatchMode) and "allow_non_fake_inputs" in inspect.signature(FakeTensorMode).parameters
    aten = torch.ops.aten
    assert aten._local_scalar_dense.default._schema.name == "aten::_local_scalar_dense"
    # storages and generators compared by identity
    t = torch.zeros(2)
    assert t.untyped_storage()._cdata == t[1:].untyped_storage()._cdata
    assert isinstance(torch.default_generator._cdata, int)
    m = torch.nn.BatchNorm1d(2)
    assert isinstance(m._buffers, dict) and isinstance(m._non_persistent_buffers_set, set)


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
