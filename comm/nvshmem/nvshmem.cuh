
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
// pes[p]: the NVSHMEM PE of rank p of the kernel's group.
__device__ void nvshmem_grid_barrier(const void* peer_table, int rank, int world, long long status_addr,
                                     long long timeout_ns, const int* pes) {
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
      for (int p = 0; p < world; ++p) nvshmem_int_atomic_add(ws + 64, 1, pes[p]);
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
__device__ __forceinline__ void nvshmem_announce(void* board, int rank, int world, long long ident,
                                                 const int* pes) {
  if (is_leader()) {
    long long* slot = reinterpret_cast<long long*>(board) + ((ident >> 32) & 1) * world + rank;
    for (int p = 0; p < world; ++p) nvshmem_longlong_atomic_set(slot, ident, pes[p]);
  }
}

// T.agree, as tilescale::grid_agree, the signatures put with nvshmem_int_p (the barrier's
// nvshmem_quiet completes them).
__device__ __forceinline__ int nvshmem_grid_agree(const void* peer_table, int rank, int world,
                                                  long long status_addr, long long timeout_ns, int signature,
                                                  const int* pes) {
  int* ws = reinterpret_cast<int*>(reinterpret_cast<const long long*>(peer_table)[rank]);
  auto barrier = [&](const void* table, int r, int w, long long status, long long timeout) {
    nvshmem_grid_barrier(table, r, w, status, timeout, pes);
  };
  return agree_with(peer_table, rank, world, status_addr, timeout_ns, signature, barrier,
                    [&](int word, int value, int p) { nvshmem_int_p(ws + word, value, pes[p]); });
}

}  // namespace tilescale
