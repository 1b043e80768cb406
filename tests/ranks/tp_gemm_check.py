"""Rank program: the fused TP GEMMs against torch.distributed + torch, and their input checks."""

import itertools
import os

import torch
import torch.distributed as dist

import tilescale as ts
from tilescale.ops._gemm import NARROW, TALL, WIDE, WIDE_192, WIDE_224, TileConfig
from tilescale.testing import assert_close

SHORT = TileConfig(64, 64, 64, 2, 128, "FullRow")
# TP_CHECK_PART="i/n" runs case c (each dtype and shape, then each graph-captured op) where c % n == i,
# so n jobs can share a GPU and compile their kernels in parallel; unset, every case runs.
PART, PARTS = map(int, os.environ.get("TP_CHECK_PART", "0/1").split("/"))
cases = itertools.count()


def summed(a: torch.Tensor, w: torch.Tensor, scatter: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum over the ranks of ``a @ w.T`` (all-reduced, or with ``scatter`` reduce-scattered
    over rows), exact in fp32, and the error a sum in ``a``'s dtype may have at each element:
    :func:`summed_atol` plus half an ulp of every rank's partial there (2^-8 of its magnitude
    in bf16). The second term is what a scalar tolerance misses: where large partials cancel,
    their rounding is the whole error (at K = 512 on two ranks, about one replay in 20 of a
    512 x 384 bf16 all-reduce had partials beyond +-64, ulp 0.5, whose sum, 0.37, came out 0;
    NCCL's sum of cuBLAS's partials does the same)."""
    part = a.float() @ w.float().T
    rounding = 2.0 ** -8 if a.dtype == torch.bfloat16 else 2.0 ** -11
    both = torch.stack([part, part.abs()], dim=1)  # one collective: rows of [partial, |partial|]
    if scatter:
        total = torch.empty(both.shape[0] // world, *both.shape[1:])
        dist.reduce_scatter_tensor(total, both)
    else:
        total = both
        dist.all_reduce(total)
    return total[:, 0], summed_atol(a.shape[1]) + rounding * total[:, 1]


def summed_atol(k: int) -> float:
    """Absolute tolerance of a sum over the ranks of partial products rounded to 16 bits, for
    what the fused kernels' own roundings add (K parts summed in 16 bits by the two-kernel
    plans, another fp32 summation order): independent errors, so their sum's grows as
    sqrt((world - 1) * k). 0.3 covers two ranks up to K = 512."""
    return 0.3 * max(1.0, ((world - 1) * k / 512) ** 0.5)


def assert_summed(got: torch.Tensor, expected: tuple[torch.Tensor, torch.Tensor], scale: float = 1.0) -> None:
    """``got / scale`` within :func:`summed`'s per-element error (and 2e-2 of the value) of its sum."""
    total, atol = expected
    ts.synchronize()  # a failed device-side wait is raised as itself, not as wrong numbers
    excess = (got.float() / scale - total).abs() - atol - 2e-2 * total.abs()
    if (excess > 0).any():
        i = divmod(int(excess.argmax()), total.shape[1])
        raise AssertionError(f"{int((excess > 0).sum())} of {total.numel()} elements off beyond rounding; worst "
                             f"at {i}: {float(got[i]) / scale} for {float(total[i])} +- {float(atol[i]):.3f}")


ts.init()
torch.set_default_device(ts.device())  # the same program checks the GPU path
rank, world = ts.rank(), ts.world_size()
g = torch.Generator(device=ts.device()).manual_seed(rank)
for dtype in (torch.float16, torch.bfloat16):
    # (16, 256, 96): one output tile, so the reduce GEMMs split K (in 4 parts on the CPU path)
    for (m, k, n) in [(64, 96, 80), (130, 64, 200), (16, 256, 96)]:
        if next(cases) % PARTS != PART:
            continue
        a = torch.randn(m, k, generator=g).to(dtype)
        w = torch.randn(n, k, generator=g).to(dtype)
        full = torch.empty(world * m, k, dtype=dtype)
        dist.all_gather_into_tensor(full, a)
        ref = (full.float() @ w.float().T)
        # SM pushers: one exchange, calls adding different arrival counts to its flags (the targets
        # keep up). Copy engines: calls alternating buffer sets, epochs counted on the host.
        # WIDE_224 / WIDE_192: choose_tile's tiles against partial waves (N not a multiple of them).
        # Consecutive calls scale their inputs by 1, 2, 4 (exact): a rank a call ahead that wrote
        # into the set of buffers a peer still reads would show.
        for i, (tile, pushers, producer) in enumerate((
                (None, 32, "sm"), (WIDE, 32, "sm"), (None, 3, "sm"), (None, 32, "sm"), (None, 32, None),
                (WIDE, 32, "copy_engine"), (None, 32, None), (WIDE_224, 32, "copy_engine"), (WIDE_192, 32, "sm"))):
            got = ts.ops.all_gather_gemm(a * 2 ** (i % 3), w, plan="fused", tile=tile, push_blocks=pushers,
                                         producer=producer)
            assert_close(got.float() / 2 ** (i % 3), ref, rtol=2e-2, atol=2e-1)
        # row parallel
        M = world * m
        a2 = torch.randn(M, k, generator=g).to(dtype)
        rs_ref = summed(a2, w, scatter=True)
        for i, tile in enumerate((None, WIDE, None, WIDE_224)):
            got = ts.ops.gemm_reduce_scatter(a2 * 2 ** (i % 3), w, plan="fused", tile=tile)
            assert_summed(got, rs_ref, 2 ** (i % 3))
        ar_ref = summed(a2, w)
        # SHORT pads the rows as NARROW does with twice the tiles: each needs its own flags; where
        # its tiles outnumber the SMs (4 on the CPU path) the gathering plan runs (segments of 130
        # rows: ragged in 64-row tiles). TALL: the decode tile of 129-256 rows (rows padded to 256).
        for i, tile in enumerate((None, NARROW, SHORT, TALL)):
            got = ts.ops.gemm_all_reduce(a2 * 2 ** (i % 3), w, plan="fused", tile=tile)
            assert_summed(got, ar_ref, 2 ** (i % 3))
        print(rank, dtype, (m, k, n), "ok", flush=True)

if next(cases) % PARTS == PART:  # decode batches of every size: one kernel per row-tile count, not per size
    from tilescale.ops.tp_gemm import all_reduce_gemm_kernel

    k, n = 96, 80
    w = torch.randn(n, k, generator=g).bfloat16()
    # 64-row tiles: 1-64 rows fill one row tile, 65-128 two; once a call of each count has
    # built its kernel, six more batch sizes build none. Calls of both counts interleave (each
    # count has its own exchange and flags).
    for i, m in enumerate((64, 128, 1, 33, 100, 65, 17, 127)):
        if i == 2:
            built = len(all_reduce_gemm_kernel._compiled)
        a = torch.randn(m, k, generator=g).bfloat16()
        ref = summed(a, w)
        got = ts.ops.gemm_all_reduce(a * 2 ** (i % 3), w, plan="fused", tile=SHORT)
        assert_summed(got, ref, 2 ** (i % 3))
    assert len(all_reduce_gemm_kernel._compiled) == built, len(all_reduce_gemm_kernel._compiled) - built
    print(rank, "gemm_all_reduce at 8 batch sizes: a kernel per row-tile count ok", flush=True)
    # choose_tile's swapped tiles (the batch in the wgmma's N): a kernel per 16 rows of batch, all
    # of them in one exchange whose slots hold 256 rows; calls of every size interleave in it.
    sizes = (64, 128, 1, 33, 100, 65, 17, 127, 200, 256, 16, 48)
    for i, m in enumerate(sizes * 2):
        a = torch.randn(m, k, generator=g).bfloat16()
        ref = summed(a, w)
        got = ts.ops.gemm_all_reduce(a * 2 ** (i % 3), w, plan="fused")
        assert_summed(got, ref, 2 ** (i % 3))
    # ("tp_gemm", "ar-in-gemm", slot rows, n, dtype, tiles, threads, K parts): one consumer warpgroup.
    shared = [key for key in ts.runtime.group_state(None).exchanges
              if key[1:5] == ("ar-in-gemm", 256, n, torch.bfloat16) and key[6] == 128]
    assert len(shared) == 1, shared
    print(rank, f"gemm_all_reduce swapped tiles at {len(sizes)} batch sizes, one exchange ok", flush=True)

if ts.device().type == "cuda":  # each fused op captured once in a CUDA graph, replayed on new inputs
    m, k, n = 256, 512, 384
    a, a2, a3 = torch.randn(m, k).bfloat16(), torch.randn(world * m, k).bfloat16(), torch.randn(200, k).bfloat16()
    a4 = torch.randn(2048, k).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()


    def check(name: str, got: torch.Tensor) -> None:
        if name == "all_gather_gemm":
            full = torch.empty(world * m, k, dtype=a.dtype)
            dist.all_gather_into_tensor(full, a)
            assert_close(got.float(), full.float() @ w.float().T, rtol=2e-2, atol=2e-1)
            return
        rows = {"gemm_all_reduce_decode": a3, "gemm_all_reduce_gather": a4}.get(name, a2)
        assert_summed(got, summed(rows, w, scatter=name == "gemm_reduce_scatter"))


    ops = {"all_gather_gemm": lambda: ts.ops.all_gather_gemm(a, w, plan="fused"),
           "gemm_reduce_scatter": lambda: ts.ops.gemm_reduce_scatter(a2, w, plan="fused"),
           "gemm_all_reduce": lambda: ts.ops.gemm_all_reduce(a2, w, plan="fused"),
           # 200 rows: choose_tile's swapped tile (208 x 64), K split, in the one-kernel plan
           "gemm_all_reduce_decode": lambda: ts.ops.gemm_all_reduce(a3, w, plan="fused"),
           # 192 tiles of 64x64 outnumber the SMs: the gathering plan (reduce-scatter GEMM, then the copy-in)
           "gemm_all_reduce_gather": lambda: ts.ops.gemm_all_reduce(a4, w, plan="fused", tile=SHORT)}
    for name, op in ops.items():
        if next(cases) % PARTS != PART:
            continue
        op()  # builds the kernels and the exchange outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = op()
        for _ in range(3):  # each replay alternates the buffer sets and raises the flag targets on the device
            a.copy_(torch.randn(m, k, generator=g))
            a2.copy_(torch.randn(world * m, k, generator=g))
            a3.copy_(torch.randn(200, k, generator=g))
            a4.copy_(torch.randn(2048, k, generator=g))
            graph.replay()
            check(name, got)
        print(rank, name, "CUDA graph, 3 replays ok", flush=True)

if next(cases) % PARTS == PART:  # each fused plan's calls are counted by its own kernels, and only those
    from expect import counted_calls

    from tilescale.ops._common import sm_count
    from tilescale.ops.tp_gemm import reduce_grid, scatter_tile

    a, a2, a3 = (torch.randn(rows, k, dtype=torch.bfloat16)
                 for rows, k in ((64, 96), (world * 64, 96), (world * 16, 256)))
    w, w3 = torch.randn(80, 96, dtype=torch.bfloat16), torch.randn(96, 256, dtype=torch.bfloat16)
    # SHORT tiles outnumber the SMs: the gathering plan.
    w4 = torch.randn(64 * (sm_count() // world + 1), 96, dtype=torch.bfloat16)
    # K = 256 is split where a segment's one tile leaves SMs idle (the GEMM, then the reduction).
    split = reduce_grid(world * 16, 256, 96, world, scatter_tile(16, 96, world)).splits > 1
    kernels = {"all_gather_gemm sm": (lambda: ts.ops.all_gather_gemm(a, w, plan="fused", producer="sm"), 2),
               "gemm_reduce_scatter": (lambda: ts.ops.gemm_reduce_scatter(a2, w, plan="fused"), 1),
               "gemm_reduce_scatter split K": (lambda: ts.ops.gemm_reduce_scatter(a3, w3, plan="fused"), 1 + split),
               "gemm_all_reduce one kernel": (lambda: ts.ops.gemm_all_reduce(a, w, plan="fused"), 1),
               "gemm_all_reduce gathering": (lambda: ts.ops.gemm_all_reduce(a2, w4, plan="fused", tile=SHORT), 2)}
    for name, (op, expected) in kernels.items():
        op()  # builds the plan and the exchange
        step, launched = counted_calls(op, 4)
        assert launched == (expected if world > 1 else 1), (name, launched)
        print(rank, name, f"counted by its {launched} kernel(s), +{step} per flag per call", flush=True)

a = torch.randn(64, 32).half()
w = torch.randn(48, 32).half()
errors = []
for call in (lambda: ts.ops.all_gather_gemm(a, w.float()),                      # dtypes differ
             lambda: ts.ops.all_gather_gemm(a.T, w),                             # not contiguous / K differs
             lambda: ts.ops.gemm_reduce_scatter(torch.randn(world * 8 + 1, 32).half(), w),  # M % world
             lambda: ts.ops.all_gather_gemm(a, w, plan="sideways"),
             # a shape no rank has used yet, but rank 0 asks for one row more: every rank gets the error
             lambda: ts.ops.all_gather_gemm(torch.randn(72 + (rank == 0), 32).half(), w, plan="fused")):
    try:
        call()
        errors.append("no error")
    except (TypeError, ValueError) as err:
        errors.append(type(err).__name__)
        last = str(err)
print(rank, "ERRORS", errors, flush=True)
print(rank, "LAST", last, flush=True)
ts.finalize()
