import os

import pytest
import torch
import torch.distributed as dist

# Tests run on 2 cores, often beside other processes: one intra-op thread per in-process test (2 threads on a
# loaded machine ran 20-50x slower). Scripts started by tests size their own threads.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _restore_torch_state():
    """Restore the default dtype, thread count and environment, and destroy a process group a test left behind."""
    dtype, threads, environ = torch.get_default_dtype(), torch.get_num_threads(), dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(environ)  # in-process fits leave MASTER_PORT, LOCAL_RANK, ... behind
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
