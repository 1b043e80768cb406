"""Cross-device signals, waits, fences and barriers: ``T.signal``, ``T.wait``, ``T.fence``, ``T.barrier``;
and the ranks' agreement on what they call: ``T.agree``, ``T.announce``.

Example (a producer block announces a tile it put into its peer's buffer)::

    T.copy(tile, B[bx * 64, 0], dst_pe=peer)        # remote put
    T.signal(flags[bx], 1, pe=peer)                  # release: the tile is visible first
    ...
    T.wait(flags[bx], "ge", 1)                       # acquire, on the consumer

All of them are *block-level* operations, like ``T.copy``: every thread of the block must
reach them (they synchronise the block), and one thread talks to the other devices.

Memory ordering, and why it holds (PTX memory model):

* A remote put may have been lowered to TMA bulk stores whose completion TileLang waits
  for only until shared memory has been *read* (``tma_store_wait<0, true>``). Before a
  signal, every thread therefore waits for its own bulk groups to *complete*
  (``cp.async.bulk.wait_group 0``) and fences the async proxy, so the data is written.
* ``__syncthreads`` then makes all threads' writes precede thread 0's
  ``fence.acq_rel.sys`` + ``st/red.release.sys``: release is cumulative, so a peer
  that observes the flag with ``ld.acquire.sys`` observes the whole block's data.
* After a wait succeeds, ``__syncthreads`` orders the acquiring thread before all others,
  and ``fence.proxy.async`` lets later TMA loads see what the generic proxy acquired.

Every wait is bounded by ``TILESCALE_WAIT_TIMEOUT_S`` (a kernel argument, no recompile).
The first wait to expire records rank, block, flag address, expected and observed values
in a status record the host reads; all other waits of the job then give up at once, the
kernel ends, and the host raises :class:`tilescale.WaitTimeoutError`.

Agreement: a kernel whose ranks must run the same call (an op at the same shapes) passes
each call's signature as a kernel argument and checks it at the point where ranks meet:
``T.agree(sig)`` is a ``T.barrier()`` that also compares the ranks' signatures and
returns 0 on a difference; ``T.announce`` + ``T.wait(..., agree=)`` do the same for ranks
that meet in flags. A difference is recorded in the same status record (one per job, like
a timeout, ending every wait) and the host raises :class:`tilescale.ShapeMismatchError`.
"""

from __future__ import annotations

import tilelang.language as tl
from tvm import tirx

from tilescale.language.cluster import cluster_barrier
from tilescale.language.remote import check_remote, remote_buffer
from tilescale.language.scale import STATUS_PARAM, TIMEOUT_PARAM, current_context

COMPARISONS = {"eq": 0, "ne": 1, "ge": 2, "gt": 3, "le": 4, "lt": 5}
SIGNAL_OPS = {"set": 0, "add": 1}
SIGNAL_SCOPES = ("block", "warp")
# The address lowering's device helpers (PRELUDE), by the roles of a DeviceLowering's
# (tilescale.comm.base): the interpreter runs either lowering's calls by these roles.
ADDRESS_HELPERS = {
    "signal": "tilescale::block_signal", "warp_signal": "tilescale::warp_signal",
    "wait": "tilescale::block_wait", "warp_wait": "tilescale::warp_wait", "fence": "tilescale::block_fence",
    "barrier": "tilescale::grid_barrier", "agree": "tilescale::grid_agree", "announce": "tilescale::announce",
}

PRELUDE = r"""
namespace tilescale {

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ bool is_leader() {
  return threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0;
}

__device__ __forceinline__ long long block_id() {
  return blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
}

// This thread's earlier global writes, TMA bulk stores included, are complete.
__device__ __forceinline__ void complete_writes() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
#endif
}

__device__ __forceinline__ void after_acquire() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.global;" ::: "memory");
#endif
}

__device__ __forceinline__ void store_release(int* p, int v) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void add_release(int* p, int v) {
  asm volatile("red.release.sys.global.add.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ bool compare(int cmp, int observed, int expected) {
  switch (cmp) {
    case 0: return observed == expected;
    case 1: return observed != expected;
    case 2: return observed >= expected;
    case 3: return observed > expected;
    case 4: return observed <= expected;
    default: return observed < expected;
  }
}

// The first failure of the job (a wait timing out, ranks disagreeing) records what happened;
// the host reads it (tilescale.errors.WAIT_STATUS_FIELDS).
__device__ __forceinline__ void report_failure(long long status_addr, long long addr, int cmp, int expected,
                                               int observed, int rank, int kind) {
  volatile long long* status = reinterpret_cast<volatile long long*>(status_addr);
  unsigned long long* state = reinterpret_cast<unsigned long long*>(status_addr);
  if (atomicCAS(state, 0ull, 2ull) == 0ull) {
    status[1] = rank; status[2] = block_id(); status[3] = addr;
    status[4] = cmp; status[5] = expected; status[6] = observed; status[7] = kind;
    __threadfence_system();
    status[0] = 1;
    __threadfence_system();
    // No printf here: a device-side call would serialise wgmma pipelines in GEMM kernels.
  }
}

__device__ __forceinline__ void report_timeout(long long status_addr, const int* addr, int cmp, int expected,
                                               int observed, int rank, int kind) {
  report_failure(status_addr, (long long)addr, cmp, expected, observed, rank, kind);
}

// A call's identity on a board (T.announce): the call number in the high 32 bits, the call's
// signature (tilescale.errors.call_signature) in the low 32; row (call number % 2) of the
// board holds every rank's latest announce of a call of that parity. True, after reporting
// it, when a rank announced this call number with another signature: it runs a different call.
__device__ __forceinline__ bool disagrees(const void* board, int world, long long ident,
                                          long long status_addr, int rank) {
  if (board == nullptr) return false;
  const long long* row = reinterpret_cast<const long long*>(board) + ((ident >> 32) & 1) * world;
  for (int p = 0; p < world; ++p) {
    long long theirs;
    asm volatile("ld.relaxed.sys.global.s64 %0, [%1];" : "=l"(theirs) : "l"(row + p) : "memory");
    if ((theirs >> 32) == (ident >> 32) && theirs != ident) {
      report_failure(status_addr, p, 0, (int)ident, (int)theirs, rank, 2);
      return true;
    }
  }
  return false;
}

// Spin until compare(cmp, *addr, expected) holds; false on timeout or when another wait of
// the job has already timed out (then the status record tells the host what happened).
template <bool kSystem>
__device__ __forceinline__ int poll(const int* p) {
  int v;
  if (kSystem) asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  else asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// kSystem: the flag is written by other GPUs (acquire at system scope); otherwise only by
// blocks of this GPU (acquire at GPU scope, which stays in L2).
template <bool kSystem>
// With a board (T.wait(..., agree=)), a peer announcing a different call ends the wait too.
__device__ __forceinline__ bool spin(const int* addr, int cmp, int expected, long long status_addr, int rank,
                     long long timeout_ns, int kind, const void* board = nullptr, int world = 0,
                     long long ident = 0) {
  volatile long long* status = reinterpret_cast<volatile long long*>(status_addr);
  unsigned long long start = now_ns();
  int observed = poll<kSystem>(addr);
  for (unsigned int i = 1; !compare(cmp, observed, expected); ++i) {
    // The status record lives in host memory: look at it, and at the clock, rarely.
    if ((i & 1023u) == 0) {
      if (status[0] != 0 || disagrees(board, world, ident, status_addr, rank)) return false;
      if ((long long)(now_ns() - start) > timeout_ns) {
        report_timeout(status_addr, addr, cmp, expected, observed, rank, kind);
        return false;
      }
    }
    observed = poll<kSystem>(addr);
  }
  // The flag's signallers announced before signalling (acquired with it): check them too.
  return !disagrees(board, world, ident, status_addr, rank);
}

__device__ __forceinline__ void block_signal(int* addr, int value, int op) {
  complete_writes();
  __syncthreads();
  if (is_leader()) {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    if (op == 0) store_release(addr, value); else add_release(addr, value);
  }
}

// T.signal(..., scope="warp"): lane 0 of each warp that runs it signals after the warp's
// writes (__syncwarp orders them before lane 0's system-scope release, as __syncthreads
// does for the block). Safe where only some warps of the block run the statement.
__device__ __forceinline__ void warp_signal(int* addr, int value, int op) {
  complete_writes();
  __syncwarp();
  if ((threadIdx.x & 31) == 0) {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    if (op == 0) store_release(addr, value); else add_release(addr, value);
  }
}

__device__ __forceinline__ void block_wait(const int* addr, int cmp, int expected, long long status_addr,
                                           int rank, long long timeout_ns, const void* board = nullptr,
                                           int world = 0, long long ident = 0) {
  if (is_leader()) spin<true>(addr, cmp, expected, status_addr, rank, timeout_ns, 0, board, world, ident);
  __syncthreads();
  after_acquire();
}

// T.wait(..., scope="warp"): lane 0 of each warp that runs it spins; __syncwarp orders the
// acquire before the warp's later reads (it orders memory among the warp's threads).
__device__ __forceinline__ void warp_wait(const int* addr, int cmp, int expected, long long status_addr,
                                          int rank, long long timeout_ns, const void* board = nullptr,
                                          int world = 0, long long ident = 0) {
  if ((threadIdx.x & 31) == 0) spin<true>(addr, cmp, expected, status_addr, rank, timeout_ns, 0, board, world, ident);
  __syncwarp();
  after_acquire();
}

__device__ __forceinline__ void block_fence() {
  complete_writes();
  asm volatile("fence.acq_rel.sys;" ::: "memory");
  __syncthreads();
}

// Barrier of every block of every rank. Workspace (int32, per rank): [0] blocks arrived,
// [32] completed barriers (epoch), [64] arrivals from ranks. Counters only grow, so
// ranks that run the same sequence of barriers agree on every target without resets.
__device__ void grid_barrier(const void* peer_table, int rank, int world, long long status_addr,
                             long long timeout_ns) {
  const long long* peers = reinterpret_cast<const long long*>(peer_table);
  complete_writes();
  __syncthreads();
  if (is_leader()) {
    int* ws = reinterpret_cast<int*>(peers[rank]);
    int blocks = gridDim.x * gridDim.y * gridDim.z;
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    int epoch = poll<false>(ws + 32);
    int arrived = atomicAdd(ws, 1);
    if (arrived == blocks - 1) {
      ws[0] = 0;
      __threadfence();
      for (int p = 0; p < world; ++p) add_release(reinterpret_cast<int*>(peers[p]) + 64, 1);
      spin<true>(ws + 64, 2, world * (epoch + 1), status_addr, rank, timeout_ns, 1);
      // GPU scope suffices: the peers' data was acquired at system scope just above, and
      // causality order is transitive, so blocks acquiring the epoch see it too.
      asm volatile("st.release.gpu.global.s32 [%0], %1;" :: "l"(ws + 32), "r"(epoch + 1) : "memory");
    } else {
      spin<false>(ws + 32, 2, epoch + 1, status_addr, rank, timeout_ns, 1);
    }
  }
  __syncthreads();
  after_acquire();
}

// T.agree: block 0 of every rank puts its call's signature into every rank's barrier
// workspace (slot 96 + parity * world + rank, released by the barrier like any write before
// it), all blocks of all ranks meet in the barrier, then the leader of each block compares
// the world signatures it received (local loads) with its own. 1 on every block of every
// rank when all agree; else 0 (the first difference is reported, the caller moves no data).
// parity = the barrier's epoch % 2: a rank writes a slot set again two barriers later, when
// every rank has passed the barrier after these reads.
template <typename Barrier, typename Put>
__device__ __forceinline__ int agree_with(const void* peer_table, int rank, int world, long long status_addr,
                                          long long timeout_ns, int signature, Barrier barrier, Put put) {
  __shared__ int agreed;
  int* ws = reinterpret_cast<int*>(reinterpret_cast<const long long*>(peer_table)[rank]);
  int slots = 0;
  if (is_leader()) {
    slots = 96 + (poll<false>(ws + 32) & 1) * world;  // the barrier's epoch: the same in every block
    if (block_id() == 0) {
      for (int p = 0; p < world; ++p) put(slots + rank, signature, p);
    }
  }
  barrier(peer_table, rank, world, status_addr, timeout_ns);
  if (is_leader()) {
    int ok = 1;
    for (int p = 0; ok && p < world; ++p) {
      int theirs = poll<false>(ws + slots + p);
      if (theirs != signature) {
        // The status record is host memory: read only here, on a difference, not by every
        // block of every call (128 blocks reading it took an H100 ~125 us per MoE combine).
        // A recorded failure (a barrier that timed out may leave stale slots) is not
        // reported over; either way this block moves no data.
        if (reinterpret_cast<volatile long long*>(status_addr)[0] == 0) {
          report_failure(status_addr, p, 0, signature, theirs, rank, 2);
        }
        ok = 0;
      }
    }
    agreed = ok;
  }
  __syncthreads();
  return agreed;
}

__device__ __forceinline__ int grid_agree(const void* peer_table, int rank, int world, long long status_addr,
                                          long long timeout_ns, int signature) {
  const long long* peers = reinterpret_cast<const long long*>(peer_table);
  return agree_with(peer_table, rank, world, status_addr, timeout_ns, signature, grid_barrier,
                    [&](int word, int value, int p) { reinterpret_cast<volatile int*>(peers[p])[word] = value; });
}

// T.announce: the leader stores this call's identity in slot `rank` of row (call number % 2)
// of every rank's board.
__device__ __forceinline__ void announce(const void* board_table, int rank, int world, long long ident) {
  if (is_leader()) {
    const long long* peers = reinterpret_cast<const long long*>(board_table);
    for (int p = 0; p < world; ++p) {
      long long* slot = reinterpret_cast<long long*>(peers[p]) + ((ident >> 32) & 1) * world + rank;
      asm volatile("st.relaxed.sys.global.s64 [%0], %1;" :: "l"(slot), "l"(ident) : "memory");
    }
  }
}

// Distributed shared memory (sm_90): the generic address of the shared variable at `p` in
// block `rank` of this cluster; ordinary loads and stores through it reach that block.
__device__ __forceinline__ long long cluster_map(const void* p, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned long long out;
  asm("mapa.u64 %0, %1, %2;" : "=l"(out) : "l"(p), "r"(rank));
  return (long long)out;
#else
  return 0;
#endif
}

// Every thread of the cluster arrives with release and waits with acquire: shared-memory
// writes (local and remote) before it are visible to every block of the cluster after it.
// The memory clobbers keep the compiler from moving shared-memory accesses across it.
__device__ __forceinline__ void cluster_barrier() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

}  // namespace tilescale
"""


def _status_args() -> list[tirx.PrimExpr]:
    ctx = current_context()
    return [ctx.scalar(STATUS_PARAM, "int64"), ctx.rank, ctx.scalar(TIMEOUT_PARAM, "int64")]


def _int32_flag(flag: tirx.BufferLoad, what: str) -> tirx.BufferLoad:
    if not isinstance(flag, tirx.BufferLoad):
        raise TypeError(f"{what} takes one element of a flag tensor, e.g. flags[i]; got {type(flag).__name__}")
    if str(flag.buffer.dtype) != "int32":
        raise TypeError(f"{what}: flag tensor '{flag.buffer.name}' must be int32, not {flag.buffer.dtype}")
    return flag


def signal(flag: tirx.BufferLoad, value: int | tirx.PrimExpr = 1, *, pe: int | tirx.PrimExpr | None = None,
           op: str = "set", scope: str = "block") -> tirx.PrimExpr:
    """Set (``op="set"``) or add to (``op="add"``) ``flag`` on rank ``pe`` with release semantics.

    Example::

        T.signal(flags[bx], 1, pe=peer, op="add")

    Everything this block wrote before (local or remote, TMA included) is visible to whoever
    observes the new value. ``pe=None`` signals this rank's own copy.

    ``scope="warp"``: every warp that runs the statement signals once, after its own writes,
    without synchronising the block: ``op="add"`` then adds ``value`` per warp (a block of
    ``threads`` adds ``value * threads // 32``). For code that only some warps run, such as
    the epilogue of a warp-specialised GEMM (its consumer warps)::

        T.signal(flags[rank], 1, pe=owner, op="add", scope="warp")
    """
    if op not in SIGNAL_OPS:
        raise ValueError(f"T.signal op must be one of {sorted(SIGNAL_OPS)}, got {op!r}")
    if scope not in SIGNAL_SCOPES:
        raise ValueError(f"T.signal scope must be one of {SIGNAL_SCOPES}, got {scope!r}")
    flag = _int32_flag(flag, "T.signal")
    lowering = current_context().lowering
    if lowering is not None:  # device calls: this rank's address of the flag, and the peer's global rank
        if pe is not None:
            check_remote(flag.buffer, pe, "T.signal's flag")
        target = current_context().global_pe(pe if pe is not None else current_context().rank)
        name = lowering.signal if scope == "block" else lowering.warp_signal
        return tl.call_extern("handle", name, tl.address_of(flag), value, SIGNAL_OPS[op], target)
    if pe is not None:
        flag = tirx.BufferLoad(remote_buffer(flag.buffer, pe, "T.signal's flag"), flag.indices)
    name = ADDRESS_HELPERS["signal" if scope == "block" else "warp_signal"]
    return tl.call_extern("handle", name, tl.address_of(flag), value, SIGNAL_OPS[op])


def wait(flag: tirx.BufferLoad, cmp: str, value: int | tirx.PrimExpr, *, scope: str = "block",
         agree: tuple[tirx.Buffer, tirx.PrimExpr] | None = None) -> tirx.PrimExpr:
    """Block until this rank's ``flag`` compares ``cmp`` to ``value``, with acquire semantics.

    Example::

        T.wait(flags[bx], "ge", step + 1)

    ``cmp`` is one of ``eq ne ge gt le lt``. The wait is bounded (see module docs).

    ``scope="warp"``: every warp that runs the statement waits on its own, without
    synchronising the block; for code that only some warps run, such as the epilogue of a
    warp-specialised GEMM (its consumer warps), which then reads what the flag announced::

        T.wait(flags[tile], "ge", target, scope="warp")

    ``agree=(board, ident)``: the wait also ends when a peer announced (``T.announce``) the
    same call number as ``ident`` with another signature, and the host raises
    :class:`tilescale.ShapeMismatchError`, instead of a timeout: for kernels whose ranks meet
    in flags rather than in a ``T.agree`` barrier. The board is checked again once the flag
    holds, so every block that signals the flag must announce before it signals.
    """
    if cmp not in COMPARISONS:
        raise ValueError(f"T.wait comparison must be one of {sorted(COMPARISONS)}, got {cmp!r}")
    if scope not in SIGNAL_SCOPES:
        raise ValueError(f"T.wait scope must be one of {SIGNAL_SCOPES}, got {scope!r}")
    flag = _int32_flag(flag, "T.wait")
    role = "wait" if scope == "block" else "warp_wait"
    lowering = current_context().lowering
    name = getattr(lowering, role) if lowering is not None else ADDRESS_HELPERS[role]
    check = []
    if agree is not None:
        board, ident = agree
        _check_board(board, "T.wait's agree")
        check = [tl.address_of(tirx.BufferLoad(board, [0])), current_context().world, ident]
    return tl.call_extern("handle", name, tl.address_of(flag), COMPARISONS[cmp], value,
                          *_status_args(), *check)


def _check_board(board: tirx.Buffer, what: str) -> None:
    if not isinstance(board, tirx.Buffer) or str(board.dtype) != "int64" or len(board.shape) != 1:
        raise TypeError(f"{what}: the board must be a 1-D int64 tensor argument (two slots per rank)")
    check_remote(board, 0, what)


def announce(board: tirx.Buffer, ident: int | tirx.PrimExpr) -> tirx.PrimExpr:
    """Store this call's identity in this rank's slot of every rank's ``board``, for the peers'
    ``T.wait(..., agree=(board, ident))``.

    Example::

        T.announce(board, ident)   # ident: (call number << 32) | signature, a kernel argument
        ...                        # this block's puts
        T.signal(flags[i], 1, pe=peer)
        ...
        T.wait(flags[i], "ge", target, agree=(board, ident))

    ``board`` is a symmetric int64 tensor of ``2 * world`` slots (row ``call number % 2``,
    slot ``rank``): the call number, the same on every rank for the same call, tells a waiting
    peer this call's identity from an earlier one's, and a rank announces call c + 2 only after
    its peers have finished call c. Every block that signals a flag checked with ``agree``
    announces before signalling (the signal releases it); it does not synchronise.
    """
    _check_board(board, "T.announce")
    ctx = current_context()
    if ctx.lowering is not None:
        return tl.call_extern("handle", ctx.lowering.announce, tl.address_of(tirx.BufferLoad(board, [0])), ctx.rank,
                              ctx.world, ident, ctx.pe_table().data)
    table = ctx.peer_table(board)
    return tl.call_extern("handle", ADDRESS_HELPERS["announce"], table.data, ctx.rank, ctx.world, ident)


def fence() -> tirx.PrimExpr:
    """Order this block's earlier global writes (local, remote, TMA) before its later ones, system-wide."""
    lowering = current_context().lowering
    return tl.call_extern("handle", lowering.fence if lowering is not None else ADDRESS_HELPERS["fence"])


def agree(signature: int | tirx.PrimExpr) -> tirx.PrimExpr:
    """A device-scope ``T.barrier()`` at which the ranks also check that they run the same call:
    1 (int32, the same in every block of every rank) when every rank passed the same
    ``signature``, else 0, and the host raises :class:`tilescale.ShapeMismatchError` on every
    rank (at the next launch, ``ts.synchronize()`` or ``ts.barrier()``; on the CPU path when the
    kernel returns).

    Example::

        ok = T.alloc_local((1,), "int32")
        ok[0] = T.agree(sig)          # sig: a kernel argument, e.g. a hash of the op and its shapes
        if ok[0] == 1:
            ...                       # read and write peers' data
        T.barrier()

    The signature is a scalar argument, so a CUDA graph replays it with the call. Cost:
    ``world`` int32 stores (block 0, before the barrier, which releases them) and ``world``
    local loads per block after it.
    """
    ctx = current_context()
    if ctx.scales[-1:] != ["device"]:
        raise RuntimeError('T.agree() must be inside a T.Scale("device") scope: it checks the ranks of the job')
    table = ctx.sync_table()
    status, rank, timeout = _status_args()
    if ctx.lowering is not None:
        return tl.call_extern("int32", ctx.lowering.agree, table.data, rank, ctx.world, status, timeout, signature,
                              ctx.pe_table().data)
    return tl.call_extern("int32", ADDRESS_HELPERS["agree"], table.data, rank, ctx.world, status, timeout, signature)


def barrier() -> tirx.PrimExpr:
    """Synchronise at the innermost ``T.Scale``: every block of every rank (``"device"``), every
    block of the thread-block cluster (``"cta_cluster"``) or the threads of the warp (``"warp"``).

    Example::

        with T.Scale("device"):
            T.copy(tile, B[bx * 64, 0], dst_pe=peer)
            T.barrier()            # all puts of all ranks have landed

    Writes before the barrier (remote ones included) are visible to every participant after
    it. Device scope: all blocks of the grid must be resident at once (the jit refuses grids
    larger than the GPU's SM count); reusable any number of times (e.g. inside loops);
    kernels that use it must not run concurrently with each other. Cluster scope: every
    thread of the block must reach it (``barrier.cluster`` is aligned).
    """
    ctx = current_context()
    if not ctx.scales:
        raise RuntimeError("T.barrier() must be inside a T.Scale(...) scope, which says what it synchronises")
    level = ctx.scales[-1]
    if level == "cta_cluster":
        return cluster_barrier()
    if level == "warp":
        return tl.call_extern("handle", "__syncwarp")
    if level == "warpgroup":
        raise NotImplementedError(
            'T.barrier() in T.Scale("warpgroup"): use a named barrier, T.sync_threads(barrier_id, 128), with '
            "an id no other part of the kernel uses (TileLang's warp specialisation takes some)"
        )
    table = ctx.sync_table()
    status, rank, timeout = _status_args()
    if ctx.lowering is not None:
        return tl.call_extern("handle", ctx.lowering.barrier, table.data, rank, ctx.world, status, timeout,
                              ctx.pe_table().data)
    return tl.call_extern("handle", ADDRESS_HELPERS["barrier"], table.data, rank, ctx.world, status, timeout)
