"""Workarounds for what TileLang compiles wrong (``tilescale/tir_fixes.py``), checked on the CUDA it generates."""

import tilelang.language as TL
from cuda_build import lower_cuda
from tilelang.engine import register_cuda_postproc

from tilescale.language import build_options
from tilescale.ops import moe, tp_gemm
from tilescale.ops._gemm import WIDE
from tilescale.tir_fixes import coherent_reads, guard_unit_loops, keep_index_arithmetic


def strided(extent):
    """13 blocks; block r stores at r, r + 13, ... for ``extent(r, B)`` steps."""

    @TL.prim_func
    def main(A: TL.Tensor((64,), "int32"), B: TL.Tensor((4,), "int32")):
        with TL.Kernel(13, threads=32) as r:
            for q in TL.serial(extent(r, B)):
                A[r + q * 13] = 1

    return main


def body(src: str) -> str:
    return src[src.index("__launch_bounds__"):]


def test_loop_of_zero_or_one_step_keeps_its_check():
    # 8 items over 13 blocks: blocks 8..12 have nothing to do. TileLang alone emits the store
    # unconditionally; guarded, the check survives.
    src = body(lower_cuda(guard_unit_loops(strided(lambda r, B: TL.ceildiv(8 - r, 13)))))
    assert "if (((int)blockIdx.x) < 8)" in src and "for (int q" not in src


def test_other_loops_are_left_alone():
    for extent in (lambda r, B: (13 - r) // 6, lambda r, B: 3, lambda r, B: B[0] - r):  # 0..2 steps, constant, any
        func = strided(extent)
        assert guard_unit_loops(func).same_as(func)


def test_all_gather_gemm_pushers_stay_in_their_row_tile():
    # K = 1024: a 128-row tile is 8 chunks of 16 rows, shared by 32 pushers; pushers 8..31 have
    # none of it, and unguarded they pushed rows of the next tiles as well.
    with build_options(world_size=2):
        func = tp_gemm.ag_own_gemm_kernel.__wrapped__(2, "bfloat16", 4096, 4096, 1024, 1024, 32, WIDE)
    assert "if (((int)blockIdx.x) < 8)" in lower_cuda(guard_unit_loops(func))


def test_kernels_that_wait_read_plain_pointers():
    # The reduction of GEMM-reduce-scatter waits for flags, then reads what peers pushed while
    # it ran: no argument may be const __restrict__ (nvcc could load it early or non-coherently).
    with build_options(world_size=2):
        waits = tp_gemm.sum_received_kernel.__wrapped__(2, 2, "bfloat16", 4096, 4096, 132)
    with coherent_reads():
        src = lower_cuda(waits)
        alone = lower_cuda(strided(lambda r, B: 3))  # no wait: qualifiers kept
    assert "tilescale::block_wait(" in src and "__restrict__" not in src and "bfloat16_t* recv," in src
    assert "int* __restrict__ A" in alone
    assert "const bfloat16_t* __restrict__ recv" in lower_cuda(waits)  # outside the block: TileLang's own


def test_kernels_that_agree_read_plain_pointers():
    # T.agree is a barrier too: MoE's combine reads the rows peers put back before it (its
    # generated source lost the fix when T.agree replaced its T.barrier(); found by reading it).
    with build_options(world_size=2):
        combine = moe.combine_kernel.__wrapped__(2, 64, 256, 4, 1024, "bfloat16", 132)
    with coherent_reads():
        src = lower_cuda(combine)
    assert "tilescale::grid_agree(" in src and "__restrict__" not in src and "bfloat16_t* back," in src


def test_coherent_reads_keeps_earlier_post_processing():
    seen = []

    def mark(code, target):
        seen.append(code)
        return code + "\n// marked"

    register_cuda_postproc(mark)
    try:
        with build_options(world_size=2):
            func = tp_gemm.sum_received_kernel.__wrapped__(2, 2, "bfloat16", 4096, 4096, 132)
        with coherent_reads():
            src = lower_cuda(func)
        assert src.endswith("// marked") and "__restrict__" not in seen[-1]  # ours first, then theirs
        assert lower_cuda(func).endswith("// marked")  # theirs alone again
    finally:
        register_cuda_postproc(lambda code, target: code)


def test_tilelang_still_drops_the_rank_from_a_left_first_index():
    """Why tilescale keeps such index arithmetic as written (``as_written``, a cast TVM cannot
    see into, and ``keep_index_arithmetic``): plain TileLang 0.1.15 compiles ``table[(rank + 3 -
    p) % 4]`` (p a loop variable) into an index without ``rank``. When this fails, TileLang
    compiles it right and both can go."""

    @TL.prim_func
    def main(out: TL.Tensor((4,), "int32"), table: TL.Tensor((4,), "int32"), rank: TL.int32):
        with TL.Kernel(1, threads=32):
            for p in TL.serial(3):
                out[p] = table[(rank + 3 - p) % 4]

    (store,) = [line.strip() for line in body(lower_cuda(main)).splitlines() if "out[p] =" in line]
    assert store == "out[p] = table[(((p <= 0) ? p : (p - 4)) * -1)];"


def subtracted_indices():
    """A store and loads whose indices divide or take the modulo of ``rank - p``, and one of ``p + rank``."""

    @TL.prim_func
    def main(out: TL.Tensor((8,), "int32"), table: TL.Tensor((8,), "int32"), rank: TL.int32):
        with TL.Kernel(1, threads=32):
            for p in TL.serial(3):
                out[(rank - p) % 4] = table[(rank - p) // 4 + 4] + table[(rank + 3 - p) % 4] + table[(p + rank) % 4]

    return main


def test_index_arithmetic_with_a_subtracted_variable_keeps_the_rank():
    src = body(lower_cuda(keep_index_arithmetic(subtracted_indices())))
    store = next(line.strip() for line in src.splitlines() if line.strip().startswith("out["))
    assert store.startswith("out[static_cast<int>(((((int64_t)rank) - ((int64_t)p)) & (int64_t)3))] =")
    assert "table[(((int64_t)static_cast<int>(((((int64_t)rank) - ((int64_t)p)) >> (int64_t)2))) + (int64_t)4)]" in src
    assert "table[static_cast<int>((((((int64_t)rank) + (int64_t)3) - ((int64_t)p)) & (int64_t)3))]" in src
    assert "table[((p + rank) & 3)]" in src  # nothing subtracted: left to TileLang


def test_a_let_bound_index_keeps_the_rank():
    # As all_gather_gemm's pushers wrote it: the peer bound first, then used as the index.
    @TL.prim_func
    def main(out: TL.Tensor((8,), "int32"), table: TL.Tensor((8,), "int32"), rank: TL.int32):
        with TL.Kernel(1, threads=32):
            for p in TL.serial(3):
                peer = (rank + 3 - p) % 4
                out[p] = table[peer]

    src = body(lower_cuda(keep_index_arithmetic(main)))
    assert "int peer = static_cast<int>((((rank + 3) - p) & 3));" in src
    assert "(p <= 0)" not in src  # the closed form without the rank


def test_kernels_without_subtracted_index_arithmetic_are_left_alone():
    func = strided(lambda r, B: (13 - r) // 6)  # a loop extent, not an index
    assert keep_index_arithmetic(func).same_as(func)
