"""tilescale: distributed tile programming on stock TileLang.

Example::

    import torch
    import tilescale as ts

    ts.init()                                   # under torchrun, tilescale run, mpirun or srun
    x = ts.zeros((1024,), dtype=torch.float32)  # symmetric: every rank owns a copy
    ts.peer_view(x, (ts.rank() + 1) % ts.world_size()).fill_(ts.rank())
    ts.barrier()
"""

from pathlib import Path as _Path

# In a source checkout, comm/ and launch/ sit beside this package (pyproject maps them to
# tilescale.comm / tilescale.launch when installed); let a checkout on sys.path, such as the
# current directory of `python -m ...`, find them the same way.
if (_Path(__file__).parent.parent / "comm" / "group.py").is_file():
    __path__.append(str(_Path(__file__).parent.parent))

from tilescale import nn, ops  # noqa: E402
from tilescale.errors import ShapeMismatchError, WaitTimeoutError
from tilescale.groups import GroupState
from tilescale.jit import jit
from tilescale.runtime import (
    backend_name,
    barrier,
    check_device_waits,
    current,
    device,
    finalize,
    group_state,
    init,
    is_initialized,
    local_rank,
    new_group,
    rank,
    synchronize,
    world_size,
)
from tilescale.symmetric import empty, is_symmetric, peer_ptrs, peer_view, zeros

__version__ = "0.1.0"

__all__ = [
    "GroupState",
    "ShapeMismatchError",
    "WaitTimeoutError",
    "backend_name",
    "barrier",
    "check_device_waits",
    "current",
    "device",
    "empty",
    "finalize",
    "group_state",
    "init",
    "is_initialized",
    "is_symmetric",
    "jit",
    "local_rank",
    "new_group",
    "nn",
    "ops",
    "peer_ptrs",
    "peer_view",
    "rank",
    "synchronize",
    "world_size",
    "zeros",
]
