"""Loading and launching kernels whose remote operations are NVSHMEM device calls.

TileLang's default execution backends compile a kernel in one ``nvcc --cubin`` step and
load the result inside their runtime, so they can neither device-link
``libnvshmem_device.a`` nor hand over the loaded module for ``nvshmemx_cumodule_init``.
This module takes TileLang's other route, the one its ``nvrtc`` backend uses for cached
kernels: the prim func is lowered with ``tilelang.lower``, TileLang's Python launcher is
generated for it, the device source is compiled relocatably and device-linked against
NVSHMEM (``tilescale.language.nvshmem.build_cubin``), the cubin is loaded as a
``CUlibrary`` by TileLang's NVRTC adapter, and NVSHMEM's device state is written into it
(``nvshmem.bindings.culibrary_init``) before the first launch. Launch configuration,
TMA descriptors, dynamic shared memory and output allocation are TileLang's own.

Example::

    with build_options(world_size=2, remote="nvshmem"):
        func = ring_shift(4096, 1024, 64)
    kernel = NvshmemKernel(func)           # tilescale.jit does this for remote="nvshmem" kernels
    kernel(A, B, *hidden_args)
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tilelang
import tilelang.env
import torch
from tilelang import tvm
from tilelang.jit.adapter.wrapper import TLPyWrapper
from tvm import tirx
from tvm.target import Target

from tilescale.language.nvshmem import build_cubin, nvshmem_home


def nvcc_arch(device: torch.device | int | None = None) -> str:
    """The nvcc ``-arch`` for the current GPU (``sm_90a`` on Hopper: wgmma and TMA need the ``a``).

    Example::

        nvcc_arch()     # "sm_90a" on an H100 or H200
    """
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def _cache_dir() -> Path:
    root = os.environ.get("TILELANG_CACHE_DIR") or Path.home() / ".tilelang" / "cache"
    return Path(root) / "tilescale-nvshmem"


@dataclass
class LinkedModule:
    """A lowered kernel, device-linked with NVSHMEM: what :class:`NvshmemKernel` loads."""

    func: tirx.PrimFunc
    target: Target
    params: list[Any]  # TileLang's KernelParam of every parameter, hidden ones included
    source: str  # the generated CUDA source
    launcher: str  # TileLang's generated Python launcher (``call(kernels, *args, stream)``)
    cubin: Path  # linked executable cubin; the launcher sits beside it as kernel.py


def link_module(func: tirx.PrimFunc, arch: str, pass_configs: dict[str, Any] | None = None,
                compile_flags: list[str] | None = None) -> LinkedModule:
    """Lower ``func`` with TileLang, generate its launcher and build the NVSHMEM-linked cubin
    (cached by source under ``TILELANG_CACHE_DIR``). Needs nvcc, not a GPU.

    Example::

        with build_options(world_size=2, remote="nvshmem"):
            module = link_module(ring_shift(4096, 1024, 64), "sm_90a")
    """
    target = Target({"kind": "cuda", "arch": arch})
    configs = pass_configs or {}
    with target, tvm.transform.PassContext(opt_level=3, config=configs):
        artifact = tilelang.lower(func, target=target)
    wrapper = TLPyWrapper(target)
    wrapper.assign_optimized_module(tvm.IRModule({func.attrs["global_symbol"]: func}))
    wrapper.assign_pass_configs(configs)
    wrapper.assign_host_module(artifact.host_mod)
    wrapper.assign_device_module(artifact.device_mod)
    launcher = wrapper.wrap(artifact.kernel_source)["host_func"]

    source = artifact.kernel_source
    key = hashlib.sha256(f"{arch}\0{nvshmem_home()}\0{compile_flags}\0{source}".encode()).hexdigest()[:24]
    workdir = _cache_dir() / key
    if not (workdir / "kernel.cubin").exists():
        # Ranks of one node share the cache: build in a private directory, then publish it whole.
        scratch = workdir.with_name(f"{key}.{os.getpid()}")
        nvcc = shutil.which("nvcc") or str(Path(tilelang.env.CUDA_HOME or "/usr/local/cuda") / "bin" / "nvcc")
        built = build_cubin(source, arch, scratch, [tilelang.env.TILELANG_TEMPLATE_PATH,
                                                    tilelang.env.CUTLASS_INCLUDE_DIR], nvcc, compile_flags)
        built.with_suffix(".py").write_text(launcher)
        try:
            scratch.rename(workdir)
        except OSError:  # another rank published it first
            shutil.rmtree(scratch, ignore_errors=True)
    return LinkedModule(func, target, artifact.params, source, launcher, workdir / "kernel.cubin")


class NvshmemKernel:
    """A TileLang kernel device-linked with NVSHMEM and initialised for this process's NVSHMEM.

    Call it like a ``tilelang.JITKernel`` (inputs in, the ``out_idx`` outputs allocated and
    returned). NVSHMEM must be initialised first (``tilescale.init(backend="nvshmem")``).
    """

    def __init__(self, func: tirx.PrimFunc, out_idx: list[int] | None = None, *,
                 pass_configs: dict[str, Any] | None = None, compile_flags: list[str] | None = None,
                 verbose: bool = False, **unsupported: Any):
        if unsupported:
            raise TypeError(f"remote='nvshmem' kernels do not take {', '.join(sorted(unsupported))}")
        if not torch.cuda.is_available():
            raise RuntimeError("remote='nvshmem' kernels run on CUDA GPUs, in a job started with "
                               "tilescale.init(backend='nvshmem'); torch sees no GPU")
        from tilelang.jit.adapter.nvrtc.adapter import NVRTCKernelAdapter

        from tilescale.comm.nvshmem import import_nvshmem

        _, bindings = import_nvshmem()
        module = link_module(func, nvcc_arch(), pass_configs, compile_flags)
        self.source = module.source
        self.adapter = NVRTCKernelAdapter.from_database(
            params=module.params, result_idx=out_idx or [], target=module.target, func_or_mod=func,
            host_kernel_source=module.launcher, device_kernel_source=module.source,
            kernel_lib_path=str(module.cubin), verbose=verbose, pass_configs=pass_configs or {},
            compile_flags=compile_flags,
        )
        status = bindings.culibrary_init(int(self.adapter.lib_generator.culib))
        if status not in (None, 0):
            raise RuntimeError(f"nvshmemx_culibrary_init failed with status {status} for {module.cubin}")
        self._call = self.adapter._convert_torch_func()

    def get_kernel_source(self) -> str:
        """The generated CUDA source (with the NVSHMEM prelude)."""
        return self.source

    def __call__(self, *args: Any) -> Any:
        return self._call(*args)
