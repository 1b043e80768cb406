"""tilescale: distributed tile programming on stock TileLang.

Example::

    import torch
    import tilescale as ts

    ts.init()                                   # under torchrun, tilescale run, mpirun or srun
    x = ts.zeros((1024,), dtype=torch.float32)  # symmetric: every rank owns a copy
    ts.peer_view(x, (ts.rank() + 1) % ts.world_size()).fill_(ts.rank())
    ts.barrier()
"""

import importlib as _importlib
import sys as _sys
import types as _types
from pathlib import Path as _Path
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

# In a source checkout, comm/ and launch/ sit beside this package (pyproject maps them to
# tilescale.comm / tilescale.launch when installed); let a checkout on sys.path, such as the
# current directory of `python -m ...`, find them the same way.
if (_Path(__file__).parent.parent / "comm" / "group.py").is_file():
    __path__.append(str(_Path(__file__).parent.parent))

from tilescale.errors import GroupedLayoutError, ShapeMismatchError, WaitTimeoutError  # noqa: E402
from tilescale.groups import GroupState  # noqa: E402
from tilescale.runtime import (  # noqa: E402
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
from tilescale.symmetric import empty, is_symmetric, peer_ptrs, peer_view, zeros  # noqa: E402

if _TYPE_CHECKING:
    from tilescale import nn, ops
    from tilescale.jit import jit


# ts.jit, ts.ops and ts.nn import TileLang (seconds of start-up): they load on first use, so that the
# launcher (which imports this package for tilescale.launch) and programs that compile no kernel do without.
def __getattr__(name: str) -> _Any:
    if name in ("nn", "ops"):
        return _importlib.import_module(f"tilescale.{name}")  # the import binds it here
    raise AttributeError(f"module 'tilescale' has no attribute {name!r}")


class _Package(_types.ModuleType):
    @property
    def jit(self) -> _Any:
        """The ``tilescale.jit`` decorator (see :func:`tilescale.jit.jit`)."""
        return _importlib.import_module("tilescale.jit").jit

    @jit.setter
    def jit(self, module: _types.ModuleType) -> None:
        """Ignore the import system binding the submodule tilescale.jit here: ``ts.jit`` stays the decorator."""


_sys.modules[__name__].__class__ = _Package


__version__ = "0.1.0"

__all__ = [
    "GroupState",
    "GroupedLayoutError",
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
