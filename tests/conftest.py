import atexit
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist

from lightning_horizon.layout.tuner import LAUNCHER_VARS

_STARTED_WITH = set(os.environ)

# The suite neither reads nor writes the user's layout cache (~/.cache/lightning_horizon): a layout tuned there would
# change the layout `devices="auto"` picks in every script a test starts, and the allocator hint's marker lives beside
# it. Every process a test starts inherits the variable.
_CACHE = tempfile.mkdtemp(prefix="horizon-tests-")
os.environ["HORIZON_LAYOUT_CACHE"] = os.path.join(_CACHE, "layouts.json")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

# Tests run on 2 cores, often beside other processes: one intra-op thread per in-process test (2 threads on a
# loaded machine ran 20-50x slower). Scripts started by tests size their own threads.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _restore_torch_state():
    """Restore the default dtype, thread count and environment, and destroy a process group a test left behind.
    Lightning's launcher variables that an in-process fit in a module-scoped fixture left behind go first: a script
    a test starts would believe it is a launched rank and wait for peers that never come."""
    for var in LAUNCHER_VARS - _STARTED_WITH:
        os.environ.pop(var, None)
    dtype, threads, environ = torch.get_default_dtype(), torch.get_num_threads(), dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(environ)  # in-process fits leave MASTER_PORT, LOCAL_RANK, ... behind
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
