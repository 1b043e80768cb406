"""tilescale's C++ launcher (``tilescale/csrc/launcher.cpp``), built at its first use by torch's
extension builder (a C++ compiler and ninja; about 30 s once, then loaded from torch's
extension cache, ``TORCH_EXTENSIONS_DIR``).

Example::

    module = launcher_module()          # None where it cannot be built: launches stay in Python
    if module is None:
        print(launcher_unavailable())   # why

``TILESCALE_NATIVE_LAUNCH=0`` keeps it unbuilt and every launch on TileLang's entry function.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

_SOURCE = Path(__file__).parent / "csrc" / "launcher.cpp"
_why_not: list[str] = []
# Every group's wait-status record (``watch_waits``), handed to the module when it loads.
_wait_records: list[torch.Tensor] = []
_loaded: list[ModuleType] = []


@functools.cache
def launcher_module() -> ModuleType | None:
    """The compiled launcher module, or None if it cannot be built here (:func:`launcher_unavailable` says why)."""
    if os.environ.get("TILESCALE_NATIVE_LAUNCH", "1") == "0":
        _why_not.append("TILESCALE_NATIVE_LAUNCH=0")
        return None
    try:
        from torch.utils import cpp_extension

        module = cpp_extension.load("tilescale_launcher", [str(_SOURCE)], extra_cflags=["-O2"], verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler or ninja: launches stay on the entry function
        _why_not.append(f"{type(e).__name__}: {e}"[:500])
        return None
    module.watch_waits(_wait_records)
    _loaded.append(module)
    return module


def watch_waits(records: Sequence[torch.Tensor]) -> None:
    """The wait-status records (every group's, ``GroupState.wait_status``) that each native call
    reads before it launches: it raises the module's ``DeviceWaitFailed`` where one reports a
    failure, and the caller ``runtime.check_device_waits()``, which says what failed. The runtime
    calls this whenever its groups change; the module, once loaded, keeps the tensors alive.

    Example::

        watch_waits([state.wait_status for state in groups])
    """
    _wait_records[:] = records
    for module in _loaded:
        module.watch_waits(_wait_records)


def launcher_unavailable() -> str:
    """Why :func:`launcher_module` gave None ('' if it built or was not asked for yet)."""
    return _why_not[-1] if _why_not else ""
