"""Remote operations lowered to NVSHMEM device calls (``build_options(remote="nvshmem")``).

The default lowering reaches a peer's copy by address, which needs every peer to be
load/store reachable. Built inside ``build_options(world_size=N, remote="nvshmem")``, a
kernel instead calls the helpers of :data:`NVSHMEM_PRELUDE`, block-level wrappers of
NVSHMEM device calls that take this rank's (symmetric) address and a peer rank:

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

NVSHMEM_PRELUDE = r"""
#include <nvshmem.h>
#include <nvshmemx.h>

namespace tilescale {

// Put of nbytes from local src (global or shared memory) to dst on rank pe; dst is this
// rank's address of a symmetric buffer. Blocking at the source, as a remote T.copy is: src
// may be overwritten on return (the syncs cover a shared src the whole block writes and
// rewrites); delivered at the next signal or fence (their nvshmem_quiet).
__device__ __forceinline__ void nvshmem_put_block(void* dst, const void* src, long long nbytes, int pe) {
  if (nbytes <= 0) return;  // a run past the tensor's end (block-uniform)
  __syncthreads();
  nvshmemx_putmem_block(dst, src, (size_t)nbytes, pe);
  __syncthreads();
}

// Blocking get: rank pe's copy of symmetric src into local dst; usable on return.
__device__ __forceinline__ void nvshmem_get_block(void* dst, const void* src, long long nbytes, int pe) {
  if (nbytes <= 0) return;  // a run past the tensor's end (block-uniform)
  nvshmemx_getmem_block(dst, src, (size_t)nbytes, pe);
  __syncthreads();
}

// A put and its uint64 NVSHMEM signal in one call: the signal lands after the data.
__device__ __forceinline__ void nvshmem_put_signal_block(void* dst, const void* src, long long nbytes,
                                                         uint64_t* sig, uint64_t value, int op, int pe) {
  nvshmemx_putmem_signal_nbi_block(dst, src, (size_t)nbytes, sig, value,
                                   op == 0 ? NVSHMEM_SIGNAL_SET : NVSHMEM_SIGNAL_ADD, pe);
}

// T.signal on rank pe: every put this block issued before is delivered before the flag.
__device__ __forceinline__ void nvshmem_block_signal(int* addr, int value, int op, int pe) {
  complete_writes();
  __syncthreads();
  if (is_leader()) {
    nvshmem_quiet();
    if (op == 0) nvshmem_int_atomic_set(addr, value, pe); else nvshmem_int_atomic_add(addr, value, pe);
  }
}

// T.signal(..., scope="warp") on rank pe: lane 0 of each warp that runs it, after the
// warp's writes; its quiet covers the puts of the calling thread's PE.
__device__ __forceinline__ void nvshmem_warp_signal(int* addr, int value, int op, int pe) {
  complete_writes();
  __syncwarp();
  if ((threadIdx.x & 31) == 0) {
    nvshmem_quiet();
    if (op == 0) nvshmem_int_atomic_set(addr, value, pe); else nvshmem_int_atomic_add(addr, value, pe);
  }
}

// tilescale's comparison codes (eq ne ge gt le lt) as NVSHMEM's.
__device__ __forceinline__ int nvshmem_cmp(int cmp) {
  switch (cmp) {
    case 0: return NVSHMEM_CMP_EQ;
    case 1: return NVSHMEM_CMP_NE;
    case 2: return NVSHMEM_CMP_GE;
    case 3: return NVSHMEM_CMP_GT;
    case 4: return NVSHMEM_CMP_LE;
    default: return NVSHMEM_CMP_LT;
  }
}

// nvshmem_int_test polled under tilescale's timeout (a timeout is reported like block_wait's).
__device__ __forceinline__ bool nvshmem_spin(int* addr, int cmp, int expected, long long status_addr, int rank,
                                             long long timeout_ns, int kind, const void* board = nullptr,
                                             int world = 0, long long ident = 0) {
  volatile long long* status = reinterpret_cast<volatile long long*>(status_addr);
  unsigned long long start = now_ns();
  int op = nvshmem_cmp(cmp);
  for (unsigned int i = 1; !nvshmem_int_test(addr, op, expected); ++i) {
    if ((i & 1023u) == 0) {
      if (status[0] != 0 || disagrees(board, world, ident, status_addr, rank)) return false;
      if ((long long)(now_ns() - start) > timeout_ns) {
        report_timeout(status_addr, addr, cmp, expected, *reinterpret_cast<volatile int*>(addr), rank, kind);
        return false;
      }
    }
  }
  return !disagrees(board, world, ident, status_addr, rank);
}

__device__ __forceinline__ void nvshmem_block_wait(int* addr, int cmp, int expected, long long status_addr,
                                                   int rank, long long timeout_ns, const void* board = nullptr,
                                                   int world = 0, long long ident = 0) {
  if (is_leader()) nvshmem_spin(addr, cmp, expected, status_addr, rank, timeout_ns, 0, board, world, ident);
  __syncthreads();
  after_acquire();
}

// T.wait(..., scope="warp"): lane 0 of each warp that runs it spins; __syncwarp orders
// the acquire before the warp's later reads.
__device__ __forceinline__ void nvshmem_warp_wait(int* addr, int cmp, int expected, long long status_addr,
                                                  int rank, long long timeout_ns, const void* board = nullptr,
                                                  int world = 0, long long ident = 0) {
  if ((threadIdx.x & 31) == 0) nvshmem_spin(addr, cmp, expected, status_addr, rank, timeout_ns, 0, board, world, ident);
  __syncwarp();
  after_acquire();
}

// This block's earlier puts and gets are complete.
__device__ __forceinline__ void nvshmem_block_fence() {
  complete_writes();
  __syncthreads();
  if (is_leader()) nvshmem_quiet();
  __syncthreads();
}

// Barrier of every block of every rank, as tilescale::grid_barrier, with the cross-rank
// arrival as NVSHMEM atomics on the symmetric workspace (this rank's address: peers[rank]).
__device__ void nvshmem_grid_barrier(const void* peer_table, int rank, int world, long long status_addr,
                                     long long timeout_ns) {
  int* ws = reinterpret_cast<int*>(reinterpret_cast<const long long*>(peer_table)[rank]);
  complete_writes();
  __syncthreads();
  if (is_leader()) {
    int blocks = gridDim.x * gridDim.y * gridDim.z;
    nvshmem_quiet();
    int epoch = poll<false>(ws + 32);
    int arrived = atomicAdd(ws, 1);
    if (arrived == blocks - 1) {
      ws[0] = 0;
      __threadfence();
      for (int p = 0; p < world; ++p) nvshmem_int_atomic_add(ws + 64, 1, p);
      nvshmem_spin(ws + 64, 2, world * (epoch + 1), status_addr, rank, timeout_ns, 1);
      asm volatile("st.release.gpu.global.s32 [%0], %1;" :: "l"(ws + 32), "r"(epoch + 1) : "memory");
    } else {
      spin<false>(ws + 32, 2, epoch + 1, status_addr, rank, timeout_ns, 1);
    }
  }
  __syncthreads();
  after_acquire();
}

// T.announce: the leader sets this rank's slot of every rank's board (its own address: board).
__device__ __forceinline__ void nvshmem_announce(void* board, int rank, int world, long long ident) {
  if (is_leader()) {
    long long* slot = reinterpret_cast<long long*>(board) + ((ident >> 32) & 1) * world + rank;
    for (int p = 0; p < world; ++p) nvshmem_longlong_atomic_set(slot, ident, p);
  }
}

// T.agree, as tilescale::grid_agree, the signatures put with nvshmem_int_p (the barrier's
// nvshmem_quiet completes them).
__device__ __forceinline__ int nvshmem_grid_agree(const void* peer_table, int rank, int world,
                                                  long long status_addr, long long timeout_ns, int signature) {
  int* ws = reinterpret_cast<int*>(reinterpret_cast<const long long*>(peer_table)[rank]);
  return agree_with(peer_table, rank, world, status_addr, timeout_ns, signature, nvshmem_grid_barrier,
                    [&](int word, int value, int p) { nvshmem_int_p(ws + word, value, p); });
}

}  // namespace tilescale
"""


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
