
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

// A flag's release once the writes it publishes are done. kSystem: a flag that peers or the
// host read (system scope). Otherwise this rank's own flag (T.signal with no pe), which only
// this GPU's blocks wait on (T.wait reads this rank's flags only): released at GPU scope, since
// a system-scope fence would also wait for the writes to reach peers and the host, which
// nobody ordered by this flag reads.
template <bool kSystem>
__device__ __forceinline__ void release(int* addr, int value, int op) {
  if (kSystem) {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    if (op == 0) store_release(addr, value); else add_release(addr, value);
  } else {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    if (op == 0) asm volatile("st.release.gpu.global.s32 [%0], %1;" :: "l"(addr), "r"(value) : "memory");
    else asm volatile("red.release.gpu.global.add.s32 [%0], %1;" :: "l"(addr), "r"(value) : "memory");
  }
}

// T.signal(..., scope="block"): the block's leader signals after every thread's writes.
template <bool kSystem>
__device__ __forceinline__ void block_release(int* addr, int value, int op) {
  complete_writes();
  __syncthreads();
  if (is_leader()) release<kSystem>(addr, value, op);
}

// T.signal(..., scope="warp"): lane 0 of each warp that runs it signals after the warp's
// writes (__syncwarp orders them before lane 0's release, as __syncthreads does for the
// block). Safe where only some warps of the block run the statement.
template <bool kSystem>
__device__ __forceinline__ void warp_release(int* addr, int value, int op) {
  complete_writes();
  __syncwarp();
  if ((threadIdx.x & 31) == 0) release<kSystem>(addr, value, op);
}

// The helpers the lowering names: a signal of a peer's flag (or any read at system scope),
// and of this rank's own flag.
__device__ __forceinline__ void block_signal(int* addr, int value, int op) { block_release<true>(addr, value, op); }
__device__ __forceinline__ void warp_signal(int* addr, int value, int op) { warp_release<true>(addr, value, op); }
__device__ __forceinline__ void local_block_signal(int* addr, int value, int op) {
  block_release<false>(addr, value, op);
}
__device__ __forceinline__ void local_warp_signal(int* addr, int value, int op) {
  warp_release<false>(addr, value, op);
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

// T.count_call: state (int32, this rank's) = [calls, flag target, blocks counted in]. Every
// thread reads the first two (nothing writes them before every counted block has read them)
// and gets this call's: call[0] = calls + 1, call[1] = target + step. After the block's reads
// (__syncthreads), its last thread counts the block in (acq_rel: the block's reads come
// before, the last block's stores after); the last of `blocks` (0: the grid) stores the
// call's values and resets the count for the next launch, which stream order puts after
// this one. The last thread, not thread 0: under TileLang's warp specialisation thread 0
// issues the first loads, while the last is a consumer's, which waits for them anyway.
// TileLang declares `state` read-only (it sees no store to it); every access here is a
// volatile asm with a memory clobber, which the compiler neither caches nor reorders.
__device__ __forceinline__ void count_call(const int* state_arg, int step, int blocks, int* call) {
  int* state = const_cast<int*>(state_arg);
  int calls, target;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(calls) : "l"(state) : "memory");
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(target) : "l"(state + 1) : "memory");
  call[0] = calls + 1;
  call[1] = target + step;
  __syncthreads();
  if (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z) == blockDim.x * blockDim.y * blockDim.z - 1) {
    int counted;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(counted) : "l"(state + 2) : "memory");
    if (counted == (blocks > 0 ? blocks : (int)(gridDim.x * gridDim.y * gridDim.z)) - 1) {
      asm volatile("st.relaxed.gpu.global.s32 [%0], %1;" :: "l"(state + 2), "r"(0) : "memory");
      asm volatile("st.relaxed.gpu.global.s32 [%0], %1;" :: "l"(state), "r"(calls + 1) : "memory");
      asm volatile("st.relaxed.gpu.global.s32 [%0], %1;" :: "l"(state + 1), "r"(target + step) : "memory");
    }
  }
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
