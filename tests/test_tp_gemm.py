"""Fused TP GEMMs and TP layers: CPU-path correctness with 2 and 4 ranks, CUDA lowering and nvcc."""

import json
import re
from pathlib import Path

import pytest
import torch
from cpu_jobs import run_cpu, run_python
from cuda_build import lower_cuda, needs_nvcc, nvcc

from tilescale.language import build_options
from tilescale.ops import tp_gemm
from tilescale.ops._gemm import DEFAULT, WIDE, WIDE_224
from tilescale.ops.tp_gemm import plan

RANKS = Path(__file__).resolve().parent / "ranks"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_fused_tp_gemms_match_torch(n):
    proc = run_cpu(str(RANKS / "tp_gemm_check.py"), n)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("(130, 64, 200) ok") == 2 * n  # fp16 and bf16, every rank
    assert proc.stdout.count("(16, 256, 96) ok") == 2 * n  # split K
    # the one-kernel all-reduce takes its rows at run time
    assert proc.stdout.count("gemm_all_reduce at 8 batch sizes: a kernel per row-tile count ok") == n
    # choose_tile's swapped tiles: 12 batch sizes of 1-256 rows interleaved in one exchange
    assert proc.stdout.count("gemm_all_reduce swapped tiles at 12 batch sizes, one exchange ok") == n
    assert proc.stdout.count("ERRORS ['TypeError', 'ValueError', 'ValueError', 'ValueError', 'ValueError']") == n
    assert proc.stdout.count("shapes differ across ranks (rank 0: [73, 32, 48") == n
    # Each fused plan's calls are counted on the device by its own kernels, one call each.
    assert proc.stdout.count(" kernel(s), +") == 5 * n


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_tp_mlp_training_on_fused_ops_matches_reference(n):
    proc = run_cpu("examples/tp_mlp_training.py", n, env={"TILESCALE_TP_PLAN": "fused"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("TP MLP training correct: matches the single-process reference") == n


@pytest.mark.timeout(300)
def test_decode_tile_alternatives_match_torch():
    """benchmarks/decode_tiles.py --small: the decode all-reduce in a 64-weight-row tile whose two
    consumer warp groups split the batch (FullCol), and in two row tiles of half the batch, checks
    against torch, as today's tile."""
    proc = run_cpu("benchmarks/decode_tiles.py", 1, args=("--small", "--tiles", "today,two,halves"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "decode-tiles" in proc.stdout


@pytest.mark.timeout(300)
def test_decode_loop_probe_matches_torch():
    """benchmarks/decode_epilogue.py --small: the decode all-reduce's grid and K loop alone (swapped,
    K split in two, and a 128x256 tile) sums to torch's product, as the fused op does."""
    proc = run_cpu("benchmarks/decode_epilogue.py", 1, args=("--small",))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "decode-epilogue" in proc.stdout


def test_floor_plot_from_a_saved_run(tmp_path):
    """benchmarks/tp_gemm.py --plot: a saved floor run's JSON plotted again beside it, its summary row
    left out, titled with the device the rows were measured on."""
    saved = tmp_path / "tp-gemm-floor-demo.json"
    rows = [{"op": "ag", "M": 1024, "K": 512, "N": 256, "fused_sm_pushers_vs_cublas": 1.05,
             "fused_copy_engine_vs_cublas": 1.02},
            {"op": "ar", "M": 128, "K": 512, "N": 256, "fused_vs_cublas": 1.1, "graph_fused_vs_cublas": 1.04},
            {"op": "summary", "M": 0, "K": 0, "N": 0, "decode": []}]
    saved.write_text(json.dumps({"device": {"gpus": ["NVIDIA H200"], "cpu": "x"}, "rows": rows}))
    proc = run_python("benchmarks/tp_gemm.py", "--plot", saved)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert saved.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


KERNELS = {
    "all_gather_gemm": lambda: tp_gemm.ag_own_gemm_kernel.__wrapped__(2, "bfloat16", 4000, 4096, 1024, 2048, 16,
                                                                       DEFAULT),
    "all_gather_gemm_wide": lambda: tp_gemm.ag_own_gemm_kernel.__wrapped__(2, "bfloat16", 4000, 4096, 1024, 2048, 16,
                                                                           WIDE),
    "all_gather_gemm_own_only": lambda: tp_gemm.ag_own_gemm_kernel.__wrapped__(2, "bfloat16", 4000, 4096, 1024,
                                                                               2048, 0, WIDE),
    "all_gather_gemm_peers": lambda: tp_gemm.ag_peer_gemm_kernel.__wrapped__(2, "bfloat16", 4000, 4096, 1024, 2048, 1,
                                                                             DEFAULT, "state"),
    "all_gather_gemm_peers_epoch": lambda: tp_gemm.ag_peer_gemm_kernel.__wrapped__(2, "bfloat16", 4000, 4096, 1024,
                                                                                   2048, 4, WIDE, "epoch"),
    "gemm_reduce_scatter_in_gemm": lambda: tp_gemm.gemm_reduce_scatter_kernel.__wrapped__(2, "bfloat16", 4096, 1024,
                                                                                          2048, WIDE, 8),
    "gemm_reduce_scatter": lambda: tp_gemm.gemm_push_kernel.__wrapped__(2, "bfloat16", 4096, 1024, 2048, 2, DEFAULT, 1),
    "gemm_reduce_scatter_wide": lambda: tp_gemm.gemm_push_kernel.__wrapped__(2, "bfloat16", 4096, 1024, 2048, 2,
                                                                             WIDE, 1),
    # Decode-sized all-reduce GEMM: 8 wide tiles, K split in 4 parts.
    "gemm_all_reduce_split": lambda: tp_gemm.gemm_push_kernel.__wrapped__(2, "bfloat16", 128, 1024, 2048, 1, WIDE, 4),
    "gemm_all_reduce": lambda: tp_gemm.gemm_push_kernel.__wrapped__(2, "float16", 128, 1024, 2048, 1, DEFAULT, 2),
    "sum_received": lambda: tp_gemm.sum_received_kernel.__wrapped__(2, 2, "bfloat16", 4096 * 2048, 4000 * 2048, 132),
    # The gathering all-reduce: segments of 2000 rows (ragged in 128-row tiles), 8 x 9 tiles each.
    "gemm_all_reduce_gather": lambda: tp_gemm.gemm_reduce_scatter_kernel.__wrapped__(2, "bfloat16", 4000, 1024, 2048,
                                                                                     WIDE_224, 8, True),
    "gather_segments": lambda: tp_gemm.gather_segments_kernel.__wrapped__(2, "bfloat16", 4000, 2048, WIDE_224),
}


def lower(name: str) -> str:
    # As the ops compile them: the reduce-scatter/all-reduce GEMMs without warp specialisation.
    configs = None
    with build_options(world_size=2):
        return lower_cuda(KERNELS[name](), configs)


@pytest.mark.timeout(120)
def test_gemm_kernels_lower_to_wgmma_with_signals():
    own = lower("all_gather_gemm")
    # The own segment's tiles read x itself and wait for nothing; the pushers put rows to peers.
    assert "wgmma" in own and "tilescale::block_wait(" not in own.split("__global__")[-1]
    assert "gathered__peers[" in own and "tilescale::block_signal(" in own
    assert "tilescale::grid_barrier(" not in own  # double-buffered: no barrier between calls
    # A flag per row tile: the pushers signal each of this rank's row tiles (32 here) at the peer.
    assert "block_signal((&(((int*)v_1)[((ts_rank * 32) + r)]))" in own
    only = lower("all_gather_gemm_own_only")  # copy-engine plan: a plain GEMM of the own rows
    assert "wgmma" in only and "__peers[" not in only and "block_signal((" not in only.split("__global__")[-1]
    peers = lower("all_gather_gemm_peers")
    # Each peer-segment tile waits for its own row tile's flag, segment from the register (TVM's
    # simplifier once folded the segment arithmetic into a closed form wrong for even ranks).
    assert "wgmma" in peers and "block_wait((&(flags[((c_segment * 32) + by)])), 2, state[1]," in peers
    assert "int by = ((tile[0] & 511) >> 4);" in peers
    epoch = lower("all_gather_gemm_peers_epoch")  # copy-engine plan: chunks of 4 row tiles, the call's epoch
    assert "block_wait((&(flags[((c_segment * 8) + (by >> 2))])), 2, epoch," in epoch
    rs = lower("gemm_reduce_scatter")
    assert "wgmma" in rs and "recv__peers[" in rs and "tilescale::grid_barrier(" not in rs
    # Warp-specialised: the consumer warps run the epilogue and signal per warp.
    assert "warpgroup_reg_dealloc" in rs and "tilescale::warp_signal((&(((int*)v_1)[ts_rank])), 1, 1)" in rs
    assert "tilescale::block_signal((" not in rs.split("__global__")[-1]
    fused = lower("gemm_reduce_scatter_in_gemm")  # own-segment tiles wait per warp, then sum the peers'
    assert fused.index("tilescale::warp_wait(") < fused.index("tilescale::warp_signal(")
    assert "tl::rasterization2DRow<8>()" in fused and "tilescale::grid_barrier(" not in fused


@pytest.mark.timeout(300)
def test_each_call_is_counted_by_its_first_kernel():
    """No kernel before a call's own: its first kernel counts it on the device
    (``T.count_call``, with what the call adds to each flag: here 8 tiles x 4 K parts x 8
    consumer warps to a sender's flag, 16 pushers' signals to a row tile's flag), before
    its announcement is released; a second kernel reads the count its first advanced."""
    push, own = lower("gemm_all_reduce_split"), lower("all_gather_gemm")
    assert "tilescale::count_call(state, 256, 0, call);" in push
    assert "tilescale::count_call(state, 16, 16, call);" in own  # only the 16 pushers count
    assert own.index("tilescale::count_call(") < own.index("tilescale::block_signal(")
    for name in ("all_gather_gemm_peers", "sum_received", "gather_segments"):
        src = lower(name)
        assert "count_call(state" not in src and "state[1]" in src and "state[0] & 1" in src, name


@pytest.mark.timeout(120)
def test_gathering_all_reduce_sends_summed_tiles_then_copies_them_in():
    """The owner's tiles sum the peers' partials, store their rows of ``out`` and put the sum
    into every peer's final slot (after the partials': slot ``2 + rank`` of 4 per buffer set)
    with a signal on the final flags (after the partials' 2 x 144); the copy-in kernel waits
    on those and copies only the rows of the segment (2000 of the 2048 padded)."""
    src = lower("gemm_all_reduce_gather")
    assert src.index("tilescale::warp_wait(") < src.index("tilescale::warp_signal(")
    assert "((int64_t)ts_rank) * (int64_t)160)" in src and "+ (int64_t)320)])), 1, 1);" in src
    copy_in = lower("gather_segments")
    assert "+ 320)])), 2, state[1]," in copy_in and "tilescale::block_signal((" not in copy_in.split("__global__")[-1]
    assert "< 125)" in copy_in  # only the 2000 rows of the segment (in 16-row vectors)


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_nvcc
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_gemm_kernels_compile_for_sm90a(name, tmp_path):
    proc = nvcc(lower(name), tmp_path / f"{name}.cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # A device-side call inside a GEMM kernel would serialise its wgmma pipeline.
    assert "wgmma.mma_async instructions are serialized" not in proc.stderr


@pytest.mark.parametrize(("m_tiles", "n_tiles", "panel"),
                         [(7, 5, 0), (7, 5, 3), (8, 5, 4), (4, 6, 8), (9, 2, 2), (5, 3, 1)])
def test_tile_coords_visit_every_tile_once_panel_by_panel(m_tiles, n_tiles, panel):
    from tvm import arith, tirx

    from tilescale.ops._gemm import tile_coords

    analyzer = arith.Analyzer()
    order = []
    for t in range(m_tiles * n_tiles):
        row, col = (int(analyzer.simplify(e)) for e in tile_coords(tirx.IntImm("int32", t), m_tiles, n_tiles, panel))
        assert 0 <= row < m_tiles and 0 <= col < n_tiles
        order.append((row, col))
    assert len(set(order)) == m_tiles * n_tiles
    if panel == 0:
        assert order == [(r, c) for r in range(m_tiles) for c in range(n_tiles)]
    else:  # panel by panel, each column by column
        rows = [r for r, _ in order]
        assert rows == sorted(rows, key=lambda r: r // panel)  # panels in order
        assert order[:min(panel, m_tiles)] == [(r, 0) for r in range(min(panel, m_tiles))]


def test_tile_config_checks_its_fields():
    from tilescale.ops._gemm import BLOCK_M, BLOCK_N, DEFAULT, THREADS, TileConfig

    assert (DEFAULT.block_M, DEFAULT.block_N, DEFAULT.threads) == (BLOCK_M, BLOCK_N, THREADS)
    assert TileConfig(128, 256, 64, 3, 256, "FullRow", "shared", 8).shared_bytes() == 208 * 1024
    with pytest.raises(ValueError, match="policy"):
        TileConfig(policy="Diagonal")
    with pytest.raises(ValueError, match="epilogue"):
        TileConfig(epilogue="tma")


def _tile_kernel(cfg):
    import tilescale.language as T
    from tilescale.ops._gemm import gemm_tile, tile_coords

    M, N, K, dtype = 1024, 1024, 512, "bfloat16"
    m_tiles, n_tiles = M // cfg.block_M, N // cfg.block_N

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K), dtype), C: T.Tensor((M, N), dtype)):
        with T.Kernel(m_tiles * n_tiles, threads=cfg.threads) as b:
            by, bx = tile_coords(b, m_tiles, n_tiles, cfg.panel)
            gemm_tile(A, by * cfg.block_M, W, bx * cfg.block_N, C, by * cfg.block_M, bx * cfg.block_N, K, dtype,
                      cfg.stages, cfg)

    return main


@pytest.mark.timeout(120)
def test_tile_configs_lower_to_their_wgmma_and_epilogue():
    from tilescale.ops._gemm import DEFAULT, TileConfig

    default = lower_cuda(_tile_kernel(DEFAULT))
    assert "kFloat32, 64, 64, 16" in default and "tma_store" not in default  # Square: 2x m64n64 per warpgroup
    wide = lower_cuda(_tile_kernel(TileConfig(128, 256, 64, 3, 256, "FullRow", "shared", 4)))
    assert "kFloat32, 64, 256, 16" in wide  # FullRow: one m64n256 per warpgroup
    assert "tma_store" in wide  # the shared epilogue stores the tile with TMA
    # Tile rows: panel (16 tiles of 4 rows x 4 columns) * 4 rows, plus the row within the panel.
    assert "(((((int)blockIdx.x) >> 4) * 512) + ((((int)blockIdx.x) & 3) * 128))" in wide
    # A shorter last panel: C division and remainder, no sign tests of floor division.
    uneven = lower_cuda(_tile_kernel(TileConfig(128, 256, 64, 3, 256, "FullRow", "shared", 3)))
    assert "% min(3, (8 - " in uneven and "?" not in uneven.split("tma_load(A_desc")[1].split(";")[0]


@pytest.mark.timeout(120)
def test_the_wide_tile_reaches_both_fused_kernels():
    """``tile=WIDE``: one m64n256 wgmma per warpgroup in every kernel, panel order in the
    all-gather GEMMs, the epilogue through shared memory."""
    ag, peers, rs = lower("all_gather_gemm_wide"), lower("all_gather_gemm_peers_epoch"), \
        lower("gemm_reduce_scatter_wide")
    for src in (ag, peers, rs):
        assert "kFloat32, 64, 256, 16" in src and "kFloat32, 64, 64, 16" not in src
    assert "tilescale::block_wait(" in peers and "tilescale::warp_signal(" in rs
    assert "tma_store" in ag and "tma_store" in peers  # the shared-memory epilogue
    # The output is (world, rows, N): each segment's TMA box is clipped at its own end (4000
    # rows here, 32 tiles of 128), so ragged segments need no padded output and no copy after.
    assert "(by * 128), ts_rank);" in ag.split("tma_store(C_desc, ")[1]
    assert "(by * 128), c_segment);" in peers.split("tma_store(C_desc, ")[1]
    assert "tl::rasterization2DRow<8>()" in rs  # the reduce-scatter GEMM's panel order


@pytest.mark.timeout(120)
def test_split_k_all_reduce_gemm_sends_each_part_to_its_slot():
    """K = 1024 in 4 parts of 256 (4 K steps each): with one row tile, part ``by`` starts
    at K offset ``by * 256`` and lands in slot ``rank * 4 + by`` (128 rows each) of every
    rank, in the buffer set the device-side call count names (8 slots per set)."""
    src = lower("gemm_all_reduce_split")
    assert "for (int k = 0; k < 4; ++k)" in src
    assert "((((int)blockIdx.y) * 256) + (k * 64))" in src
    assert "((((call[0] & 1) * 1024) + (ts_rank * 512)) + (((int)blockIdx.y) * 128))" in src
    assert "tilescale::warp_signal(" in src


@pytest.mark.parametrize(("tiles", "K", "expected"), [(32, 14336, 4), (64, 14336, 2), (256, 14336, 1),
                                                      (32, 64 * 3, 1), (1, 1 << 20, 8)])
def test_k_splits_fill_the_sms_with_whole_k_steps(tiles, K, expected, monkeypatch):
    monkeypatch.setattr(plan, "sm_count", lambda: 132)
    assert tp_gemm.k_splits(tiles, K, 64) == expected


@pytest.mark.parametrize(("rows", "n", "split_k", "kernels", "k", "expected"), [
    (8192, 14336, False, (1,), None, "WIDE"), (128, 8192, False, (1,), None, "DEFAULT"),
    (1024, 14336, False, (1,), None, "WIDE_224"),  # 512 tiles = 3.9 waves, where 448 wide ones are 3.4
    (3000, 7392, False, (1,), None, "WIDE_224"),  # 792 tiles: 6 whole waves
    (2048, 9216, False, (1,), None, "WIDE_192"),  # 768 tiles = 5.8 waves; 128x256: 4.4, 128x224: 5.1
    (512, 14336, False, (1, 1), None, "WIDE_224"),  # all-gather GEMM on 2 ranks: 2 kernels of 256 tiles
    (3000, 7168, True, (1,), None, "WIDE_224"),
    # Decode all-reduce: the batch in the wgmma's N, rounded up to 16 rows; 64 weight rows per tile.
    (128, 8192, True, (1,), None, (128, 64)), (64, 8192, True, (1,), None, (64, 64)),
    (1, 4096, True, (1,), None, (16, 64)), (33, 8192, True, (1,), 14336, (48, 64)),
    (128, 2048, True, (1,), None, (128, 64)),  # 32 tiles: K split 4 ways
    (256, 4096, True, (1,), 4096, (256, 64)), (200, 7168, True, (1,), 2304, (208, 64)),
    (256, 8192, True, (1,), 14336, (256, 128)),  # 7168 of K per block: 128 weight rows per A load
    (100, 8192, True, (1,), 14336, (112, 64)),  # up to 128 rows 64 columns whatever K
    (64, 12288, True, (1,), None, (64, 128)),  # 192 tiles of 64 columns would not fit the SMs
    (64, 20480, True, (1,), None, "THIN"),  # nor 160 of 128: tiles of the two-kernel plan
    (64, 8192, True, (2,), None, "NARROW"),  # reduce-scatter segments keep the 128-row tile
    (1024, 8192, True, (1,), None, "WIDE"),  # 256 wide tiles, 2 whole waves
    (128, 8192, True, (2,), None, "NARROW"),  # reduce-scatter of 256 rows on 2 ranks: segments of 128 rows
    (200, 7168, True, (2,), None, "TALL"),  # one 256-row tile streams the weight once
])
def test_choose_tile(rows, n, split_k, kernels, k, expected, monkeypatch):
    from tilescale.ops import _gemm

    monkeypatch.setattr(plan, "sm_count", lambda: 132)
    tile = tp_gemm.choose_tile(rows, n, split_k, kernels, k)
    if isinstance(expected, str):
        assert tile == getattr(_gemm, expected)
    else:
        assert tile.swap_ab and (tile.block_M, tile.block_N) == expected
        assert tile.threads == 2 * tile.block_N and tile.shared_bytes() + tile.block_M * tile.block_N * 2 <= 208 * 1024


def test_swapped_tiles_only_in_the_decode_all_reduce():
    """Every other kernel computes its tiles the usual way round and refuses a swapped one."""
    from tilescale.ops._gemm import swapped_tile

    with pytest.raises(ValueError, match="gemm_push_kernel does not take swap_ab tiles"):
        tp_gemm.gemm_push_kernel.__wrapped__(2, "bfloat16", 128, 1024, 8192, 1, swapped_tile(100), 1)
    with pytest.raises(ValueError, match="swapped_tile: rows must be 1-256"):
        swapped_tile(257)
    with pytest.raises(ValueError, match="block_M a multiple of 8"):
        type(swapped_tile(16))(12, 64, 64, 4, 128, "FullRow", "direct", swap_ab=True)


def test_reduce_grid_pads_segments_to_whole_tiles(monkeypatch):
    from tilescale.ops._gemm import TALL

    monkeypatch.setattr(plan, "sm_count", lambda: 132)
    assert tp_gemm.reduce_grid(128, 14336, 8192, 1, WIDE) == tp_gemm.GemmGrid(WIDE, 128, 32, 4)
    assert tp_gemm.reduce_grid(200, 2304, 7168, 1, TALL) == tp_gemm.GemmGrid(TALL, 256, 56, 2)
    assert tp_gemm.reduce_grid(3000, 4608, 7168, 2, WIDE) == tp_gemm.GemmGrid(WIDE, 1536, 12 * 28, 1)


@pytest.mark.timeout(300)
@needs_nvcc
def test_decode_all_reduce_is_one_kernel(tmp_path):
    """M = 128, N = 8192 with the 128x64 tile: 128 tiles, one per SM. Each block computes its
    tile over the whole K, puts the partial to its peer and signals, then waits for the
    peer's partial of the same tile and sums: one kernel, warp-specialised, so the consumer
    warps signal and wait per warp; the slot in the buffer set the device-side call count names."""
    from tilescale.ops._gemm import NARROW

    with build_options(world_size=2):
        func = tp_gemm.all_reduce_gemm_kernel.__wrapped__(2, "bfloat16", 128, 1024, 8192, NARROW)
    src = lower_cuda(func)
    assert "wgmma" in src and "warpgroup_reg_dealloc" in src
    assert "recv__peers[" in src and "call[0] & 1" in src
    assert src.index("tilescale::warp_signal(") < src.index("tilescale::warp_wait(")
    assert "tilescale::block_wait(" not in src and "tilescale::grid_barrier(" not in src
    proc = nvcc(src, tmp_path / "all_reduce_gemm.cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.timeout(300)
@needs_nvcc
def test_decode_all_reduce_swapped_tile_puts_the_batch_in_the_wgmma_n(tmp_path):
    """A decode batch of 100 rows in its ``swap_ab`` tile: one m64n112 wgmma per K step (the
    weight's 64 rows as its M), K split in two: each K part's fp32 partial, transposed, stored
    in the rank-local ``parts`` buffer, its own flag signalled, the row slice summed over both
    parts and only that slice put to the peer; the slots laid out for 256 rows (shared by
    every batch size's kernel)."""
    from tilescale.ops._gemm import swapped_tile

    tile = swapped_tile(100)
    with build_options(world_size=2):
        func = tp_gemm.all_reduce_gemm_kernel.__wrapped__(2, "bfloat16", 112, 2048, 4096, tile, 2, 256)
    src = lower_cuda(func)
    assert "__launch_bounds__(256, 1)" in src and "kFloat32, 64, 112, 16" in src
    assert tile.stages == 8 and "mbarrier[(k & 7)]" in src and "tilescale::warp_wait(" in src
    assert "(call[0] & 1) * 512)" in src  # a buffer set: a 256-row slot per sender, not per K part
    assert "float* __restrict__ parts" in src and "(q * 1048576)" in src  # K part q's 256 x 4096 fp32 slot
    # Stored and signalled on this rank, then read back once every part has arrived.
    read_back = re.search(r"float4 \w+ = \*\(float4\*\)\(parts", src).start()  # the parts' vector loads
    # The K parts meet in this rank's own flag, released at GPU scope; the peers' at system scope.
    assert src.index("parts[") < src.index("tilescale::local_warp_signal(") < read_back < src.index("recv__peers[")
    assert read_back < src.index("tilescale::warp_signal(")
    proc = nvcc(src, tmp_path / "all_reduce_gemm_swapped.cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_decode_all_reduce_kernel_takes_whole_row_tiles():
    """Its rows are a run-time size up to ``padded_rows``, which must be whole tiles."""
    from tilescale.ops._gemm import NARROW

    with pytest.raises(ValueError, match="padded_rows 100 is not a multiple of block_M 128"):
        tp_gemm.all_reduce_gemm_kernel.__wrapped__(2, "bfloat16", 100, 1024, 8192, NARROW)


def test_wave_efficiency_and_the_default_plan_arithmetic(monkeypatch):
    """The floor's misses follow the waves of one 128x256 tile; the GPU default weighs them
    against the collective that the unfused plan waits for."""
    monkeypatch.setattr(plan, "sm_count", lambda: 132)
    assert tp_gemm.wave_efficiency([448], 132) == pytest.approx(448 / 528)  # 1024 x 14336: 3.4 waves
    assert tp_gemm.wave_efficiency([132, 132], 132) == 1.0
    # AG 8192 x 8192 x 14336 on 2 ranks: 2 x 1792 tiles, 14 full waves each; 64 MB to gather.
    assert tp_gemm._fused_wins(2 * 8192 * 8192 * 14336, [1792, 1792], 4096 * 8192 * 2)
    # AG 1024 rows: 4 x 56 tiles per kernel leave most of a wave idle twice; 8 MB gather is cheaper.
    assert not tp_gemm._fused_wins(2 * 1024 * 8192 * 14336, [224, 224], 512 * 8192 * 2)
    # RS 1000 x 1792 x 4096 on 2 ranks: a 20 us GEMM; eager, both plans' host time decides, and the
    # fused plan's one kernel has less of it (73 us against 88-101 us on 2x H200, 2026-11-27).
    assert tp_gemm._fused_wins(2 * 1000 * 1792 * 4096, [2 * 4 * 16], 1000 * 4096)
    # A tiny eager GEMM, both plans at their host floors: the fused one's is lower.
    assert plan.FUSED_HOST_US < plan.UNFUSED_HOST_US
    # The one-kernel decode all-reduce moves (world - 1) outputs per rank, NCCL 2 (world - 1) / world:
    # the default at two ranks, not at four (0.78-0.93x NCCL + cuBLAS on 4x H100) or eight.
    out = 128 * 8192 * 2
    assert tp_gemm.one_kernel_wins(2, 128, False, out) and tp_gemm.one_kernel_wins(2, 128, True, out)
    assert not tp_gemm.one_kernel_wins(4, 128, False, out) and not tp_gemm.one_kernel_wins(8, 64, True, out // 2)
    # Captured, above 128 rows up to 3 MiB of output (2x H200, swapped tiles: 200 x 7168 and 256 x 4096 won,
    # 256 x 8192 lost, 0.98x); eagerly at any size.
    assert tp_gemm.one_kernel_wins(2, 256, False, 256 * 8192 * 2)
    assert tp_gemm.one_kernel_wins(2, 200, True, 200 * 7168 * 2)
    assert tp_gemm.one_kernel_wins(2, 256, True, 256 * 4096 * 2)
    assert not tp_gemm.one_kernel_wins(2, 256, True, 256 * 8192 * 2)
    assert tp_gemm.one_kernel_wins(2, 128, True, 128 * 14336 * 2)  # up to 128 rows whatever N


def test_pushers_hold_their_sms_until_the_rows_are_out():
    # 384 tiles of 65 us on 132 SMs: 3 waves with every SM; 32 pushers holding an SM for 45 us
    # push the last 20 tiles into a fourth round (they start at 175 us).
    assert tp_gemm.own_kernel_us(384, 65.0, 132, 0, 0.0) == pytest.approx(195.0)
    assert tp_gemm.own_kernel_us(384, 65.0, 132, 32, 45.0) == pytest.approx(240.0)
    # 4 pushers idle 4 SMs for 170 us: 128 SMs still finish the 384 tiles in 3 waves.
    assert tp_gemm.own_kernel_us(384, 65.0, 132, 4, 170.0) == pytest.approx(195.0)
    # The kernel is not done before its pushers: rows that take longer than the tiles.
    assert tp_gemm.own_kernel_us(100, 10.0, 132, 4, 400.0) == pytest.approx(400.0)


@pytest.mark.parametrize(("rows", "k", "n", "world", "tile", "expected"), [
    # 2x H100, graph replays (2026-11-28): 4 pushers 391 us, 8-32 439-444 us (a fourth wave)
    (1024, 7168, 9216, 2, "WIDE_192", 4),
    # 256 tiles, 2 waves with 8 spare SMs: 4 and 8 pushers fit (339-340 us), 16 and 32 not (369-374)
    (512, 8192, 14336, 2, "WIDE_224", 8),
    # 33.5 MB to send: 4 pushers leave the rows late (705 us), 8-32 did not (625-632 us)
    (4096, 4096, 6144, 2, "WIDE", 32),
    # 396 tiles, 3 whole waves: every pusher costs a fourth, the most send soonest (578-585 us, 32 best)
    (1500, 8192, 7392, 2, "WIDE_224", 32),
    # three peers' rows: the few pushers that fit at 2 ranks send them too slowly
    (1024, 7168, 9216, 4, "WIDE_192", 32),
])
def test_choose_push_blocks_leaves_the_gemm_its_waves(rows, k, n, world, tile, expected, monkeypatch):
    from tilescale.ops import _gemm

    monkeypatch.setattr(plan, "sm_count", lambda: 132)
    assert tp_gemm.choose_push_blocks(rows, k, n, world, getattr(_gemm, tile), 2) == expected


@pytest.mark.parametrize(("m_tiles", "k", "expected"), [(64, 8192, 4), (8, 8192, 4), (2, 1024, 1), (1, 64, 1),
                                                        (40, 1024, 20)])
def test_copy_engine_chunks_are_about_8_mb_and_at_least_two(m_tiles, k, expected):
    assert tp_gemm.chunk_tiles(m_tiles, k, 128, 2) == expected


def test_copy_engines_move_only_large_rows_of_eager_calls_with_mapped_peers():
    # Measured at 2 ranks (2026-11-27): the copy engines lost below ~32 MB per rank, won above 64 MB.
    big, small = tp_gemm.COPY_ENGINE_MIN_BYTES, tp_gemm.COPY_ENGINE_MIN_BYTES - 1
    assert tp_gemm.default_producer(big, capturing=False, mapped=True) == "copy_engine"
    assert tp_gemm.default_producer(4096 * 8192 * 2, capturing=False, mapped=True) == "copy_engine"  # 64 MiB
    assert tp_gemm.default_producer(small, capturing=False, mapped=True) == "sm"
    assert tp_gemm.default_producer(750 * 4096 * 2, capturing=False, mapped=True) == "sm"  # 6 MB: 1.6x slower by copy
    assert tp_gemm.default_producer(big, capturing=True, mapped=True) == "sm"  # host-counted flags: not capturable
    assert tp_gemm.default_producer(big, capturing=False, mapped=False) == "sm"  # NVSHMEM calls: no mapped peers


def test_fused_plan_on_gpus_takes_two_byte_dtypes(monkeypatch):
    """On a GPU the fused kernels' pipelines are sized for 2-byte elements (float32 failed to
    launch on an H200: 288-384 KB of shared memory asked for): float32 runs unfused unless the
    fused plan is asked for, which raises rather than fail inside TileLang."""
    from types import SimpleNamespace

    rt = SimpleNamespace(tp_plan=None)  # TILESCALE_TP_PLAN as ts.init() read it
    monkeypatch.setattr(plan.runtime, "current", lambda: rt)
    monkeypatch.setattr(plan.runtime, "device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(plan.runtime, "group_state", lambda group: SimpleNamespace(size=2))
    monkeypatch.setattr(plan, "kernel_lowering", lambda group: None)
    assert plan._choose(None, 4096, True, None, torch.bfloat16) == "fused"
    assert plan._choose(None, 4096, True, None, torch.float16) == "fused"
    assert plan._choose(None, 4096, True, None, torch.float32) == "unfused"
    assert plan._choose("unfused", 4096, True, None, torch.float32) == "unfused"
    with pytest.raises(TypeError, match="take bfloat16 or float16 on GPUs, got torch.float32"):
        plan._choose("fused", 4096, True, None, torch.float32)
    rt.tp_plan = "fused"
    with pytest.raises(TypeError, match="use plan='unfused'"):
        plan._choose(None, 4096, True, None, torch.float32)


def test_reduce_scatter_tiles_are_never_swapped(monkeypatch):
    """A group of one rank has one segment, as the decode all-reduce: its reduce-scatter GEMM
    still takes an unswapped tile (its kernels refuse swapped ones)."""
    monkeypatch.setattr(plan, "sm_count", lambda: 132)
    assert tp_gemm.choose_tile(64, 1024, split_k=True, kernels=(1,)).swap_ab  # the all-reduce's
    for rows, world in ((64, 1), (200, 1), (64, 2), (16, 8)):
        assert not tp_gemm.scatter_tile(rows, 1024, world).swap_ab
