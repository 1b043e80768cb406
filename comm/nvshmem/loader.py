"""Loading and launching kernels whose remote operations are NVSHMEM device calls.

TileLang's default execution backends compile a kernel in one ``nvcc --cubin`` step and
load the result inside their runtime, so they can neither device-link
``libnvshmem_device.a`` nor hand over the loaded module for ``nvshmemx_cumodule_init``.
This module takes the route of TileLang's ``nvrtc`` backend instead: the prim func is
lowered with ``tilelang.lower``, TileLang's Python launcher is generated for it, the
device source is compiled relocatably and device-linked against NVSHMEM
(``tilescale.comm.nvshmem.lowering.build_cubin``), the cubin is loaded as a ``CUlibrary``, and
NVSHMEM's device state is written into it (``nvshmem.bindings.culibrary_init``) before the
first launch. Launch configuration, TMA descriptors and dynamic shared memory are
TileLang's own (its launcher, told here about dynamic dimensions such as
``T.dynamic("n") * 8`` that it would otherwise miss), but for one thing: the device link
appends NVSHMEM's static shared memory to the kernel's and drops the alignment TileLang
declares for its dynamic buffer (1024 bytes, which TMA's 128-byte swizzle needs; misaligned,
the first TMA load faults), so the buffer is aligned at run time inside an allocation that
much larger (:func:`align_dynamic_shared`).

Example::

    with build_options(world_size=2, remote="nvshmem"):
        func = ring_shift(4096, 1024, 64)
    kernel = NvshmemKernel(func)           # tilescale.jit does this for remote="nvshmem" kernels
    kernel(A, B, *hidden_args)
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tilelang
import tilelang.env
import torch
from tilelang import tvm
from tvm import tirx
from tvm.target import Target

from tilescale.comm.nvshmem.lowering import build_cubin, nvshmem_home
from tilescale.tir_fixes import coherent_reads


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


def _free_vars(expr: tirx.PrimExpr) -> list[tirx.Var]:
    found: list[tirx.Var] = []
    tirx.stmt_functor.post_order_visit(expr, lambda node: found.append(node) if isinstance(node, tirx.Var) else None)
    return found


def _shape_symbols(func: tirx.PrimFunc) -> dict[str, tuple[str, int, int, int]]:
    """Every variable in the buffer shapes of ``func``'s parameters: name -> (dtype, parameter,
    dimension, factor), where ``shape[dimension] == factor * variable`` (TileLang's own
    Python launcher handles only bare variables, not ``T.dynamic("n") * 8``)."""
    symbols: dict[str, tuple[str, int, int, int]] = {}
    others: dict[str, str] = {}  # variables seen only inside other expressions, with one such place
    for i, param in enumerate(func.params):
        buf = func.buffer_map.get(param)
        for d, dim in enumerate(buf.shape if buf is not None else []):
            if isinstance(dim, tirx.Var):
                symbols.setdefault(dim.name, (str(dim.dtype), i, d, 1))
            elif isinstance(dim, tirx.Mul) and isinstance(dim.a, tirx.Var) and isinstance(dim.b, tirx.IntImm):
                symbols.setdefault(dim.a.name, (str(dim.a.dtype), i, d, int(dim.b.value)))
            else:
                others.update({var.name: f"{buf.name} dimension {d} ({dim})" for var in _free_vars(dim)})
    unsolved = [where for name, where in others.items() if name not in symbols]
    if unsolved:
        raise NotImplementedError("remote='nvshmem' kernels take dynamic dimensions of the form n or n * c; got "
                                  + ", ".join(unsolved))
    return symbols


# Warp-specialised kernels are built without it: device-linked, their launch faulted with a
# misaligned address on an H100 (TileLang 0.1.15, NVSHMEM 3.4.5), relocatable code drops
# the register reallocation (setmaxnreg) they rely on, and NVSHMEM's block-wide calls need
# every thread of the block, where only the consumer warps run the epilogue.
WARP_SPECIALIZATION_OFF = "tl.disable_warp_specialized"

_DYNAMIC_SHARED = re.compile(r"extern __shared__ __align__\((\d+)\) uchar buf_dyn_shmem\[\];")


def align_dynamic_shared(source: str) -> tuple[str, int]:
    """``source`` with TileLang's dynamic shared buffer aligned at run time, and the bytes of
    slack that needs (0 when the kernel has no such buffer).

    Relocatable device code keeps only the section's 16-byte alignment, and the static shared
    memory that the device link adds (NVSHMEM's) shifts the dynamic buffer off the declared
    boundary; the buffer is moved up to it within ``slack`` extra bytes.

    Example::

        source, slack = align_dynamic_shared(artifact.kernel_source)   # slack 1024 for a TMA GEMM
    """
    aligns = [int(a) for a in _DYNAMIC_SHARED.findall(source)]

    def aligned(found: re.Match) -> str:
        align = found.group(1)
        return (f"extern __shared__ __align__({align}) uchar ts_dyn_shmem_base[];\n"
                f"  uchar* buf_dyn_shmem = ts_dyn_shmem_base + (({align}u - "
                f"(static_cast<unsigned>(__cvta_generic_to_shared(ts_dyn_shmem_base)) % {align}u)) % {align}u);")

    return _DYNAMIC_SHARED.sub(aligned, source), max(aligns, default=0)


def _launcher_source(target: Target, func: tirx.PrimFunc, artifact: Any, pass_configs: dict[str, Any],
                     slack: int) -> str:
    """TileLang's Python launcher (``call(kernels, *params, *dynamic symbols, stream)``) for
    ``func``, asking for ``slack`` more bytes of dynamic shared memory."""
    from tilelang.jit.adapter.nvrtc.wrapper import TLNVRTCSourceWrapper

    symbols = _shape_symbols(func)

    class Wrapper(TLNVRTCSourceWrapper):
        def get_dynamic_symbolic_set(self, prim_func: tirx.PrimFunc) -> list[tuple[str, str]]:
            return [(name, dtype) for name, (dtype, *_) in symbols.items()]

        def parse_source_information(self) -> None:
            super().parse_source_information()
            self.dynamic_smem_buf = {name: size if size is None else size + slack
                                     for name, size in self.dynamic_smem_buf.items()}

    wrapper = Wrapper(scheduled_ir_module=tvm.IRModule({func.attrs["global_symbol"]: func}),
                      source=artifact.kernel_source, target=target, device_mod=artifact.device_mod,
                      host_mod=artifact.host_mod, pass_configs=pass_configs)
    return wrapper.host_func


@dataclass
class LinkedModule:
    """A lowered kernel, device-linked with NVSHMEM: what :class:`NvshmemKernel` loads."""

    params: list[Any]  # TileLang's KernelParam of every parameter, hidden ones included
    source: str  # the generated CUDA source
    launcher: str  # TileLang's generated Python launcher
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
    configs = {**(pass_configs or {}), WARP_SPECIALIZATION_OFF: True}
    with target, tvm.transform.PassContext(opt_level=3, config=configs), coherent_reads():
        artifact = tilelang.lower(func, target=target)
    source, slack = align_dynamic_shared(artifact.kernel_source)
    launcher = _launcher_source(target, func, artifact, configs, slack)
    key = hashlib.sha256(f"{arch}\0{nvshmem_home()}\0{compile_flags}\0{source}\0{launcher}".encode()).hexdigest()
    workdir = _cache_dir() / key[:24]
    if not (workdir / "kernel.cubin").exists():
        # Ranks of one node share the cache: build in a private directory, then publish it whole.
        scratch = workdir.with_name(f"{workdir.name}.{os.getpid()}")
        nvcc = shutil.which("nvcc") or str(Path(tilelang.env.CUDA_HOME or "/usr/local/cuda") / "bin" / "nvcc")
        built = build_cubin(source, arch, scratch, [tilelang.env.TILELANG_TEMPLATE_PATH,
                                                    tilelang.env.CUTLASS_INCLUDE_DIR], nvcc, compile_flags)
        built.with_suffix(".py").write_text(launcher)
        try:
            scratch.rename(workdir)
        except OSError:  # another rank published it first
            shutil.rmtree(scratch, ignore_errors=True)
    return LinkedModule(artifact.params, source, launcher, workdir / "kernel.cubin")


class NvshmemKernel:
    """A TileLang kernel device-linked with NVSHMEM and initialised for this process's NVSHMEM.

    Called like a ``tilelang.JITKernel``: inputs in; the ``out_idx`` outputs (static shapes)
    are allocated and returned. NVSHMEM must be initialised first
    (``tilescale.init(backend="nvshmem")``).
    """

    def __init__(self, func: tirx.PrimFunc, out_idx: list[int] | None = None, *,
                 pass_configs: dict[str, Any] | None = None, compile_flags: list[str] | None = None,
                 **unsupported: Any):
        if unsupported:
            raise TypeError(f"remote='nvshmem' kernels do not take {', '.join(sorted(unsupported))}")
        if not torch.cuda.is_available():
            raise RuntimeError("remote='nvshmem' kernels run on CUDA GPUs, in a job started with "
                               "tilescale.init(backend='nvshmem'); torch sees no GPU")
        import cuda.bindings.driver as cuda

        from tilescale.comm.nvshmem import import_nvshmem

        _, bindings = import_nvshmem()
        module = link_module(func, nvcc_arch(), pass_configs, compile_flags)
        self.source = module.source
        spec = importlib.util.spec_from_file_location(f"tilescale_nvshmem_{module.cubin.parent.name}",
                                                      module.cubin.with_suffix(".py"))
        self._launcher = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self._launcher)
        status, self._library = cuda.cuLibraryLoadFromFile(str(module.cubin).encode(), [], [], 0, [], [], 0)
        if status != cuda.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLibraryLoadFromFile({module.cubin}) failed: {status}")
        status = bindings.culibrary_init(int(self._library))
        if status not in (None, 0):
            raise RuntimeError(f"nvshmemx_culibrary_init failed with status {status} for {module.cubin}")
        self._kernels = {}
        for name in self._launcher._function_names:
            status, self._kernels[name] = cuda.cuLibraryGetKernel(self._library, name.encode())
            if status != cuda.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"kernel {name} not found in {module.cubin}: {status}")
        self._outputs = []
        for i in out_idx or []:
            param = module.params[i]
            if not all(isinstance(d, tirx.IntImm) for d in param.shape):
                raise NotImplementedError("remote='nvshmem' kernels allocate outputs of static shape only")
            self._outputs.append((i, [int(d) for d in param.shape], param.torch_dtype()))
        self._symbols = [(i, d, factor) for _, i, d, factor in _shape_symbols(func).values()]
        self._arity = len(func.params)

    def get_kernel_source(self) -> str:
        """The generated CUDA source (with the NVSHMEM prelude)."""
        return self.source

    def __call__(self, *args: Any) -> Any:
        values = list(args)
        if len(values) + len(self._outputs) != self._arity:
            raise TypeError(f"kernel takes {self._arity - len(self._outputs)} arguments, got {len(values)}")
        device = next(v.device for v in values if isinstance(v, torch.Tensor))
        outputs = []
        for i, shape, dtype in self._outputs:
            outputs.append(torch.empty(shape, dtype=dtype, device=device))
            values.insert(i, outputs[-1])
        dynamic = []
        for i, d, factor in self._symbols:
            extent = values[i].shape[d]
            if extent % factor:
                raise ValueError(f"argument {i}'s dimension {d} ({extent}) must be a multiple of {factor}")
            dynamic.append(extent // factor)
        self._launcher.call(self._kernels, *values, *dynamic, stream=torch.cuda.current_stream(device).cuda_stream)
        if not outputs:
            return None
        return outputs[0] if len(outputs) == 1 else outputs
