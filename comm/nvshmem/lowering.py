"""Remote operations lowered to NVSHMEM device calls (``build_options(remote="nvshmem")``).

The default lowering reaches a peer's copy by address, which needs every peer to be
load/store reachable. Built inside ``build_options(world_size=N, remote="nvshmem")``, a
kernel instead calls the helpers of :data:`NVSHMEM_PRELUDE`, block-level wrappers of
NVSHMEM device calls that take this rank's (symmetric) address and a peer's NVSHMEM PE:

==========================  =====================================================================
tilescale operation         NVSHMEM device calls
==========================  =====================================================================
``T.copy(.., dst_pe=pe)``   ``nvshmemx_putmem_block`` (one per contiguous run)
``T.copy(.., src_pe=pe)``   ``nvshmemx_getmem_block`` (one per contiguous run)
``T.signal(f, v, pe=pe)``   ``nvshmem_quiet`` then ``nvshmem_int_atomic_set`` / ``_add`` (leader)
``T.signal(scope="warp")``  the same, from lane 0 of each warp that runs it
``T.wait(f, cmp, v)``       ``nvshmem_int_test`` polled under tilescale's timeout
``T.fence()``               ``nvshmem_quiet``
``T.barrier()`` (device)    grid arrival, then ``nvshmem_int_atomic_add`` to every rank's counter
``T.agree(sig)``            ``nvshmem_int_p`` of the signature to every rank, then that barrier
``T.announce(board, id)``   ``nvshmem_longlong_atomic_set`` into every rank's board
``put_signal`` helper       ``nvshmemx_putmem_signal_nbi_block`` (uint64 signal, for callers
                            that fuse a put with its flag)
==========================  =====================================================================

PE numbers: NVSHMEM's one-sided calls address PEs of ``NVSHMEM_TEAM_WORLD`` (the job's
ranks), while a kernel's ranks are those of its process group. The language translates
every peer through the kernel's table of its group's global ranks (``pes[pe]``) and hands
the table to the helpers that loop over the group (barrier, agree, announce): that is what
``nvshmem_team_translate_pe(team, pe, NVSHMEM_TEAM_WORLD)`` would compute for an NVSHMEM
team of the group, without creating one. Teams are not used because creating one
(``nvshmem_team_split_*``) is collective over its parent team, i.e. every PE of the job,
while a tilescale group is set up by its own members only, at its first use; and a team
would buy nothing here (tilescale's barriers and agreement run on its own workspace).

Building: the helpers call into ``libnvshmem_device.a``, so the module is compiled
relocatable and device-linked (:func:`build_cubin`):
``nvcc -rdc=true --cubin`` then ``nvcc -dlink --cubin ... -lnvshmem_device``. The
result is an ordinary executable cubin; before its first launch the host must run
``nvshmemx_cumodule_init`` (nvshmem4py: ``nvshmem.bindings.cumodule_init``) on the loaded
module, which writes the NVSHMEM device state into it. Headers and device library must be
the version of the host library the process loads (``nvidia-nvshmem-cu13==3.4.5``, the
one torch pins). comm/README.md says which TileLang execution path can do both steps.

Example::

    with build_options(world_size=16, remote="nvshmem"):
        func = my_kernel_factory(...)
    src = tilelang.lower(func, target="cuda").kernel_source    # calls tilescale::nvshmem_*
    cubin = build_cubin(src, "sm_90a", Path("build/"))
"""

import os
import subprocess
from pathlib import Path

from tilescale.comm.base import DeviceLowering

# The helpers, CUDA (shipped as package data), placed after tilescale's own prelude.
NVSHMEM_PRELUDE = (Path(__file__).parent / "nvshmem.cuh").read_text()


def nvshmem_home() -> Path:
    """The pip NVSHMEM package (``include/``, ``lib/libnvshmem_device.a``); raises if it is not installed.

    Example::

        nvshmem_home() / "lib" / "libnvshmem_device.a"
    """
    override = os.environ.get("NVSHMEM_HOME")
    if override:
        return Path(override)
    try:
        import nvidia.nvshmem as package
    except ImportError:
        raise ImportError(
            'remote="nvshmem" kernels need the NVSHMEM headers and device library: pip install '
            '"nvidia-nvshmem-cu13==3.4.5" (or set NVSHMEM_HOME)'
        ) from None
    return Path(next(iter(package.__path__)))


def nvshmem_compile_flags() -> list[str]:
    """nvcc flags for compiling a kernel that calls the NVSHMEM helpers (relocatable device code).

    Example::

        nvshmem_compile_flags()   # ["-rdc=true", "-I.../nvidia/nvshmem/include"]
    """
    return ["-rdc=true", f"-I{nvshmem_home() / 'include'}"]


def nvshmem_link_flags() -> list[str]:
    """Device-link inputs that resolve the NVSHMEM device calls.

    Example::

        nvshmem_link_flags()      # ["-L.../nvidia/nvshmem/lib", "-lnvshmem_device"]
    """
    return [f"-L{nvshmem_home() / 'lib'}", "-lnvshmem_device"]


NVSHMEM_LOWERING = DeviceLowering(
    name="nvshmem",
    prelude=NVSHMEM_PRELUDE,
    put="tilescale::nvshmem_put_block",
    get="tilescale::nvshmem_get_block",
    signal="tilescale::nvshmem_block_signal",
    warp_signal="tilescale::nvshmem_warp_signal",
    wait="tilescale::nvshmem_block_wait",
    warp_wait="tilescale::nvshmem_warp_wait",
    fence="tilescale::nvshmem_block_fence",
    barrier="tilescale::nvshmem_grid_barrier",
    agree="tilescale::nvshmem_grid_agree",
    announce="tilescale::nvshmem_announce",
    compile_flags=nvshmem_compile_flags,
    link=nvshmem_link_flags,
    loader="tilescale.comm.nvshmem.loader:NvshmemKernel",
)


def build_cubin(source: str, arch: str, workdir: Path, include_dirs: list[str] | None = None,
                nvcc: str = "nvcc", extra: list[str] | None = None) -> Path:
    """Compile generated CUDA ``source`` relocatably and device-link it with ``libnvshmem_device.a``.

    Example::

        cubin = build_cubin(kernel.get_kernel_source(), "sm_90a", Path("/tmp/k"),
                            [tilelang.env.TILELANG_TEMPLATE_PATH, tilelang.env.CUTLASS_INCLUDE_DIR])

    ``extra``: more flags for the compile step (a kernel's ``compile_flags``). Returns the
    linked, executable cubin (``workdir/kernel.cubin``); raises
    ``RuntimeError`` with nvcc's output when a step fails.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    # nvcc picks an input's kind by its suffix: the relocatable object is a .cubin too.
    cu, obj, cubin = workdir / "kernel.cu", workdir / "kernel_rdc.cubin", workdir / "kernel.cubin"
    cu.write_text(source)
    includes = [f"-I{d}" for d in include_dirs or []]
    steps = [
        [nvcc, "-std=c++20", "-O3", f"-arch={arch}", "--cubin", *nvshmem_compile_flags(), *includes,
         "-DENABLE_BF16", "--expt-relaxed-constexpr", "-w", *(extra or []), "-o", str(obj), str(cu)],
        [nvcc, f"-arch={arch}", "-dlink", "--cubin", str(obj), *nvshmem_link_flags(), "-o", str(cubin)],
    ]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}\nfailed:\n{done.stdout}{done.stderr}")
    return cubin
