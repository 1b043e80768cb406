"""Would the decode GEMM reach cuBLAS with its batch tile shared over a 2-CTA cluster?

The decode all-reduce (``ts.ops.gemm_all_reduce`` at up to 256 rows) computes its GEMM in
swapped tiles: 64 weight rows per CTA in the wgmma's M, the whole batch in its N, 128 CTAs
for 8192 columns. Under ncu on one H200 it streams HBM at 65-73% of peak where cuBLAS, on
the same 128 CTAs, reaches 73-81%: cuBLAS runs them as clusters of two that load the tile they
share once, by TMA multicast (docs/performance-log.md, "The decode GEMM under ncu"). TileLang's
automatic pipeline cannot do that safely: its producer refills a stage after waiting for its
own consumers only, while a multicast also writes the partner's stage.

This probe times the GEMM part alone, on one GPU, three ways, each checked first against an
fp32 reference, then as CUDA-graph replays taking turns (CUDA events, median):

* ``unicast``: the same tiles in the decode kernel's main loop of today (TileLang's
  warp-specialised pipeline, each CTA loading both its tiles itself);
* ``two_consumers``: the same pipeline, each CTA with the whole batch, K whole and two consumer
  warp groups taking half the batch each (:func:`unicast_gemm` with ``consumers=2``);
* ``multicast``: :func:`multicast_gemm`, a hand-written producer / consumer pipeline over a
  2-CTA cluster (CTA 0 multicasts the batch tile, each CTA loads its own weight tile; above
  128 rows each CTA takes half the batch and the weight tile is the shared one, as cuBLAS does
  at 256 rows with K whole; a stage is empty once each consumer warp of both CTAs released it);
* cuBLAS (``a @ w.T``).

::

    python benchmarks/decode_multicast.py            # one sm_90a GPU (H100/H200)
    python benchmarks/decode_multicast.py --quick    # one shape

The table and JSON (``benchmarks/results/decode-multicast-<device>-<time>.json``) give each
kernel's time and its ratio to cuBLAS.
"""

import argparse

import tilelang
import tilelang.language as T
import torch
from harness import Report, check_close, columns_against, measure_shapes, replays_against

# Batch rows x input features x output columns of one rank's decode GEMM (Llama-3-70B at TP 2:
# K = 14336, N = 8192; Qwen2.5-72B at TP 4 rounded to whole K steps: K = 7168).
SHAPES = [(128, 14336, 8192), (64, 14336, 8192), (128, 7168, 8192), (32, 14336, 8192), (256, 3584, 4096),
          (256, 14336, 8192), (96, 14336, 8192), (192, 14336, 8192)]
# Above this many rows a CTA takes half the batch and the pair shares the weight tile instead
# (cuBLAS's choice at 256 rows, where it keeps K whole: the decode kernel splits K there).
HALF_BATCH_ABOVE = 128
BLOCK_N, BLOCK_K = 64, 64  # weight rows per CTA (the wgmma's M), K step
SHARED_BYTES = 196608  # pipeline stages' budget of shared memory per CTA
# The hand-written pipeline's forms (share a tile over a cluster, keep one K step's wgmmas in flight).
HAND_WRITTEN = {"multicast": (True, False), "multicast_in_flight": (True, True), "manual_in_flight": (False, True)}
# The hand-written pipeline synchronises itself: TileLang's own warp specialisation stays off.
MANUAL_PIPELINE = {"tl.disable_warp_specialized": True}


def stages_for(rows: int) -> int:
    """Pipeline stages of a swapped tile of ``rows`` batch rows within ``SHARED_BYTES`` (at most 8)."""
    return min(8, SHARED_BYTES // ((rows + BLOCK_N) * BLOCK_K * 2))


def cta_rows(M: int) -> int:
    """Batch rows per CTA: the whole batch up to ``HALF_BATCH_ABOVE`` rows, else half of it."""
    return M // 2 if M > HALF_BATCH_ABOVE else M


def shared_tile(M: int) -> str:
    """The operand tile the two CTAs of a cluster share: ``"batch"`` (each CTA its own 64
    weight rows, the whole batch shared) where a CTA takes the whole batch, else ``"weight"``
    (each CTA half the batch, the 64 weight rows shared)."""
    return "batch" if cta_rows(M) == M else "weight"


def multicast_gemm(M: int, K: int, N: int, stages: int, share: bool = True, in_flight: bool = False):
    """``out = a @ w.T`` (bf16 in, fp32 out) in swapped 64-column tiles, two CTAs per cluster
    sharing one operand tile (:func:`shared_tile`) by TMA multicast through a hand-written pipeline.

    Warp group 0 of each CTA produces: it waits until stage ``s`` is empty, loads its own tile
    into it and, in CTA 0, multicasts the shared tile into both CTAs' stage ``s``; every
    producer thread then arrives on "full", after the one elected to issue the copies has
    announced their bytes, so a stage cannot count as full before its bytes are due. Warp
    group 1 consumes: it waits for "full", runs the wgmmas and, once they are done, each of its
    warps arrives on "empty" in both CTAs. So a stage is empty only when both CTAs' consumers
    have released it: the multicast never overwrites a stage the partner still reads. A
    cluster sync before exit keeps a CTA alive while its partner may still arrive on it.

    With ``in_flight``, a K step's wgmmas are not waited for before the next step's are
    issued (``wgmma.wait_group 1``): a stage is released one step later, once the wgmmas that
    read it are known done, so the tensor cores get the next step's work while the consumer
    waits for its data (CUTLASS's Hopper main loop; ``T.gemm`` alone waits for each step).

    Args:
        M: Batch rows, a multiple of 16 (the wgmma's N; of 32 where the CTAs halve the batch).
        K: Input features, a multiple of 64.
        N: Output columns, a multiple of 128 (whole clusters of 64-column tiles).
        stages: Pipeline stages (:func:`stages_for`).
        share: Whether the CTAs pair up in clusters sharing a tile (False: each CTA loads both
            of its tiles itself, the same hand-written pipeline without a cluster).
        in_flight: Whether one K step's wgmmas stay in flight while the next step's are issued.

    Returns:
        The kernel's ``T.prim_func`` (compile with ``pass_configs=MANUAL_PIPELINE``).
    """
    steps, rows = K // BLOCK_K, cta_rows(M)
    halves = rows < M
    pair = 2 if share else 1  # CTAs of a cluster
    a_mask = None if halves or not share else 3  # the tile CTA 0 multicasts to both
    w_mask = 3 if halves and share else None

    @T.prim_func
    def main(a: T.Tensor((M, K), "bfloat16"), w: T.Tensor((N, K), "bfloat16"), out: T.Tensor((M, N), "float32")):
        with T.ClusterKernel(N // BLOCK_N * (2 if halves else 1), threads=256, cluster_dims=(pair, 1, 1)) as bx:
            col = bx // 2 if halves else bx  # the CTA's 64 weight rows
            row0 = bx % 2 * rows if halves else 0  # its first batch row
            a_s = T.alloc_shared((stages, rows, BLOCK_K), "bfloat16")
            w_s = T.alloc_shared((stages, BLOCK_N, BLOCK_K), "bfloat16")
            acc = T.alloc_fragment((BLOCK_N, rows), "float32")
            full = T.alloc_barrier([128] * stages)  # every producer thread, and the stage's bytes
            empty = T.alloc_cluster_barrier([4 * pair] * stages)  # each consumer warp of the cluster's CTAs
            tx = T.get_thread_binding()
            if tx < 128:
                for k in T.serial(steps):
                    s = k % stages
                    T.mbarrier_wait_parity(empty[s], ((k // stages) & 1) ^ 1)
                    T.tma_copy(a[row0:row0 + rows, k * BLOCK_K:(k + 1) * BLOCK_K], a_s[s, :, :], barrier=full[s],
                               cluster_mask=a_mask)
                    T.tma_copy(w[col * BLOCK_N:(col + 1) * BLOCK_N, k * BLOCK_K:(k + 1) * BLOCK_K], w_s[s, :, :],
                               barrier=full[s], cluster_mask=w_mask)
                    T.mbarrier_arrive(full[s])
            else:
                T.clear(acc)
                for k in T.serial(steps):
                    s = k % stages
                    T.mbarrier_wait_parity(full[s], (k // stages) & 1)
                    T.gemm(w_s[s, :, :], a_s[s, :, :], acc, transpose_B=True,
                           annotations={"wg_wait": 1} if in_flight else None)
                    done = (k + stages - 1) % stages if in_flight else s  # the stage whose wgmmas are done
                    if tx % 32 == 0 and (not in_flight or k > 0):
                        for cta in T.unroll(pair):
                            T.mbarrier_arrive(empty[done], cta)
                if in_flight:
                    T.wait_wgmma(0)
                for j, i in T.Parallel(BLOCK_N, rows):
                    out[row0 + i, col * BLOCK_N + j] = acc[j, i]
            if share:
                T.cluster_sync()

    return main


def unicast_gemm(M: int, K: int, N: int, stages: int, consumers: int = 1):
    """The same GEMM in TileLang's automatic warp-specialised pipeline, each CTA loading both
    its tiles itself. With one consumer warp group, the tiles of :func:`shared_tile` (CTAs of
    half the batch above ``HALF_BATCH_ABOVE`` rows): the decode all-reduce kernel's main loop
    up to 128 rows. With two, each CTA keeps the whole batch and K whole (128 CTAs for 8192
    columns, as cuBLAS has) and its two consumer warp groups take half the batch each, so one
    issues wgmmas while the other waits for its own: above ~100 rows the tensor cores, not
    HBM, bound this GEMM (2 * rows FLOPs per weight byte against the H200's ~206).

    Args:
        M, K, N, stages: as :func:`multicast_gemm`'s.
        consumers: Consumer warp groups per CTA, 1 or 2 (2: ``M`` a multiple of 16).

    Returns:
        The kernel's ``T.prim_func``.
    """
    rows = cta_rows(M) if consumers == 1 else M
    halves = rows < M
    policy = T.GemmWarpPolicy.FullCol  # warp groups side by side along the batch (the wgmma's N)

    @T.prim_func
    def main(a: T.Tensor((M, K), "bfloat16"), w: T.Tensor((N, K), "bfloat16"), out: T.Tensor((M, N), "float32")):
        with T.Kernel(N // BLOCK_N * (2 if halves else 1), threads=128 * consumers) as bx:
            col = bx // 2 if halves else bx
            row0 = bx % 2 * rows if halves else 0
            a_s = T.alloc_shared((rows, BLOCK_K), "bfloat16")
            w_s = T.alloc_shared((BLOCK_N, BLOCK_K), "bfloat16")
            acc = T.alloc_fragment((BLOCK_N, rows), "float32")
            T.clear(acc)
            for k in T.Pipelined(K // BLOCK_K, num_stages=stages):
                T.copy(a[row0, k * BLOCK_K], a_s)
                T.copy(w[col * BLOCK_N, k * BLOCK_K], w_s)
                T.gemm(w_s, a_s, acc, transpose_B=True, policy=policy)
            for j, i in T.Parallel(BLOCK_N, rows):
                out[row0 + i, col * BLOCK_N + j] = acc[j, i]

    return main


def measure(shape: tuple[int, int, int], iters: int) -> dict:
    """One shape: both kernels checked against the fp32 product, then timed with cuBLAS."""
    m, k, n = shape
    g = torch.Generator(device="cuda").manual_seed(m + k + n)
    a = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    expected = a.float() @ w.float().T
    stages = stages_for(cta_rows(m))
    kernels = {"unicast": tilelang.compile(unicast_gemm(m, k, n, stages), out_idx=None),
               "two_consumers": tilelang.compile(unicast_gemm(m, k, n, stages_for(m), consumers=2), out_idx=None),
               **{name: tilelang.compile(multicast_gemm(m, k, n, stages, share, in_flight), out_idx=None,
                                         pass_configs=MANUAL_PIPELINE)
                  for name, (share, in_flight) in HAND_WRITTEN.items()}}
    outs = {name: torch.empty(m, n, device="cuda") for name in kernels}
    row = {"shape": f"{m}x{k}x{n}", "shared": shared_tile(m), "stages": stages, "checks": []}
    calls = {"cublas": lambda: a @ w.T}
    for name, kernel in kernels.items():
        calls[name] = lambda kernel=kernel, out=outs[name]: kernel(a, w, out)
        calls[name]()
        row["checks"].append(check_close(f"{row['shape']} {name}", outs[name], expected, rtol=1e-2, atol=1e-2))
    replays_against(row, calls, "cublas", iters)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="only the first shape")
    args = parser.parse_args()
    kernels = ["unicast", "two_consumers", *HAND_WRITTEN]
    report = Report("decode-multicast", columns=["shape", "shared", "stages", *columns_against(kernels, "cublas")])
    measure_shapes(report, SHAPES[:1] if args.quick else SHAPES, lambda shape: measure(shape, args.iters))


if __name__ == "__main__":
    main()
