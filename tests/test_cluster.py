"""Thread-block clusters (``T.Scale("cta_cluster")``, distributed shared memory) without a GPU.

What the kernels lower to (``mapa`` addresses, remote stores and loads through them, the
cluster barrier with release/acquire), that the sources compile with nvcc for sm_90a and
keep that PTX, the errors for bad input, and the CPU path running cluster programs with
the GPU's semantics (blocks of a cluster concurrent, each other's tiles reachable).

No ``from __future__ import annotations`` here: TileLang evaluates the kernels' annotations.
"""

import functools
import importlib
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cpu_jobs import RANKS, example_output, run_python
from cuda_build import lower_cuda, needs_nvcc, nvcc
from tvm import tirx

import tilescale.language as T
from tilescale.language.sync import PRELUDE

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def example(name: str) -> dict:
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"), run_name=f"{name}_example")


@functools.cache
def splitk_source(splits: int = 4) -> str:
    return lower_cuda(example("cluster_splitk_gemm")["splitk_gemm"].__wrapped__(128, 8192, 14336, 128, splits))


@functools.cache
def shared_operand_source() -> str:
    return lower_cuda(example("cluster_shared_operand_gemm")["gemm"].__wrapped__(8192, 8192, 8192, cluster=2))


def kernel_body(src: str) -> str:
    return src[src.index('extern "C" __global__ void __launch_bounds__'):]


# --- lowering ------------------------------------------------------------------------------------


def test_splitk_puts_through_mapa_addresses_between_cluster_barriers():
    body = kernel_body(splitk_source())
    # One put per destination block, each through the address mapa gives for that block.
    assert body.count("tilescale::cluster_map((&(((float*)inbox)[0])), r)") == 1
    assert "for (int r = 0; r < 4; ++r)" in body
    put = body.index("tilescale::cluster_map")
    first, second = body.index("tilescale::cluster_barrier();"), body.rindex("tilescale::cluster_barrier();")
    assert first < put < second  # the inbox is free before the puts; they have landed after
    # The remote stores are vectorised generic stores, never a bulk copy to global memory.
    assert "*(float4*)(((float*)v) +" in body
    assert "tma_store(" not in body[first:second]
    # The block's rank in the cluster is the hardware's (%cluster_ctarank).
    assert "tl::block_rank_in_cluster()" in body


def test_shared_operand_gathers_from_every_block_into_the_local_tile():
    body = kernel_body(shared_operand_source())
    assert "tilescale::cluster_map((&(((bfloat16_t*)slices)[0])), p)" in body
    assert "for (int p = 0; p < 2; ++p)" in body
    assert body.count("tilescale::cluster_barrier();") == 2  # one per K step, one before the end
    assert "cp.async" not in body and "tma_load" not in body  # gets are plain loads from the peer


def test_prelude_has_the_dsmem_ptx_with_release_and_acquire():
    assert 'asm("mapa.u64 %0, %1, %2;"' in PRELUDE
    assert 'asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");' in PRELUDE
    assert 'asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");' in PRELUDE


def test_cluster_launch_is_recorded_for_the_launcher():
    func = example("cluster_splitk_gemm")["splitk_gemm"].__wrapped__(64, 7168, 16384, 128, 2)
    dims = []
    tirx.stmt_functor.post_order_visit(
        func.body, lambda n: dims.append(list(n.annotations["cluster_dims"]))
        if isinstance(n, tirx.SBlock) and "cluster_dims" in n.annotations else None)
    assert dims == [[1, 2, 1]]


def warp_scopes():
    @T.prim_func
    def main(A: T.Tensor((256,), "float32")):
        with T.Kernel(1, threads=256):
            with T.Scale("warpgroup") as (group, groups):
                A[group] = T.float32(groups)
            with T.Scale("warp") as (warp, warps):
                A[warp + 2] = T.float32(warps)
                T.barrier()

    return main


def test_warp_and_warpgroup_scopes_give_index_and_count():
    body = kernel_body(lower_cuda(warp_scopes()))
    assert "A[tl::get_warp_group_idx()] = 0x1p+1f/*2.000000e+00*/;" in body  # 2 warpgroups
    assert "A[(((int64_t)tl::get_warp_idx()) + (int64_t)2)] = 0x1p+3f/*8.000000e+00*/;" in body  # 8 warps
    assert "__syncwarp();" in body


@needs_nvcc
@pytest.mark.timeout(400)
def test_nvcc_compiles_cluster_kernels_for_sm90a(tmp_path):
    for name, src in (("splitk", splitk_source()), ("shared_operand", shared_operand_source())):
        result = nvcc(src, tmp_path / f"{name}.ptx", "ptx")
        assert result.returncode == 0, result.stderr[-3000:]
        ptx = (tmp_path / f"{name}.ptx").read_text()
        assert ".target sm_90a" in ptx
        assert "mapa.u64" in ptx
        assert "barrier.cluster.arrive.release.aligned" in ptx and "barrier.cluster.wait.acquire.aligned" in ptx
        if name == "splitk":
            assert "st.v4.f32" in ptx  # the puts: 16-byte stores through the mapa'd generic address


@needs_nvcc
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("rows", "shared"), [(128, "a_desc"), (256, "w_desc")])
def test_multicast_decode_probe_guards_both_ctas_stages_and_compiles(rows, shared, tmp_path):
    """benchmarks/decode_multicast.py's hand-written cluster pipeline: CTA 0 multicasts the shared
    tile (the batch's, or above 128 rows the weight's), a stage is empty only after each consumer
    warp of both CTAs released it, full only after every producer thread arrived; no CTA exits
    before its partner is done with it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    probe = importlib.import_module("decode_multicast")
    src = lower_cuda(probe.multicast_gemm(rows, 1024, 512, stages=4), probe.MANUAL_PIPELINE)
    body = kernel_body(src)
    assert body.count("tl::tma_load_multicast(") == 1 and f"tl::tma_load_multicast({shared}" in body
    assert "tl::block_rank_in_cluster() == 0" in body
    assert body.count("empty[0].init(8);") == 1 and body.count("full[0].init(128);") == 1
    assert "empty[(k_1 & 3)].arrive(cta);" in body and "cta < 2" in body  # each consumer warp, in both CTAs
    assert body.rstrip().endswith("tl::cluster_sync();\n}")  # the kernel's last statement
    assert "warpgroup_reg_alloc" not in body  # TileLang's own warp specialisation stays off
    result = nvcc(src, tmp_path / "decode_multicast.ptx", "ptx")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster" in (
        tmp_path / "decode_multicast.ptx").read_text()


@needs_nvcc
@pytest.mark.timeout(400)
@pytest.mark.parametrize("share", [True, False])
def test_decode_probe_keeps_a_k_step_of_wgmmas_in_flight_and_compiles(share, tmp_path):
    """decode_multicast.py's ``in_flight`` forms: a K step's wgmmas are waited for only down to one
    group (``wgmma.wait_group 1``), so the stage released is the previous step's, and all of them
    before the accumulator is read."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    probe = importlib.import_module("decode_multicast")
    src = lower_cuda(probe.multicast_gemm(128, 1024, 512, stages=4, share=share, in_flight=True),
                     probe.MANUAL_PIPELINE)
    body = kernel_body(src)
    assert "tl::warpgroup_wait<1>();" in body and "tl::warpgroup_wait<0>();" not in body
    assert body.index("tl::warpgroup_wait<1>();") < body.index("empty[((k_1 + 3) & 3)].arrive(")
    assert body.index("tl::wait_wgmma<0>();") < body.index("out[")
    assert body.count("empty[0].init(8);" if share else "empty[0].init(4);") == 1
    assert ("tl::tma_load_multicast(" in body) == share
    result = nvcc(src, tmp_path / "decode_in_flight.ptx", "ptx")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "wgmma.wait_group.sync.aligned 1;" in (tmp_path / "decode_in_flight.ptx").read_text()


# --- errors --------------------------------------------------------------------------------------


def cluster_kernel(cluster_dims, grid=(4,), dst_cta=1, scope=True, dst_global=False):
    @T.prim_func
    def main(A: T.Tensor((64, 64), "float32")):
        with T.Kernel(*grid, threads=128, cluster_dims=cluster_dims):
            tile = T.alloc_shared((16, 64), "float32")
            if scope:
                with T.Scale("cta_cluster"):
                    T.copy(tile, A[0:16, :] if dst_global else tile, dst_cta=dst_cta)
            else:
                T.copy(tile, tile, dst_cta=dst_cta)

    return main


def barrier_in_warpgroup():
    @T.prim_func
    def main(A: T.Tensor((64,), "float32")):
        with T.Kernel(1, threads=256):
            with T.Scale("warpgroup"):
                T.barrier()

    return main


def both_cta_sides():
    @T.prim_func
    def main(A: T.Tensor((64,), "float32")):
        with T.Kernel(2, threads=128, cluster_dims=2):
            tile = T.alloc_shared((64,), "float32")
            with T.Scale("cta_cluster"):
                T.copy(tile, tile, dst_cta=0, src_cta=1)

    return main


@pytest.mark.parametrize(
    ("build", "error", "pattern"),
    [
        (lambda: cluster_kernel(None), ValueError, r'T\.Scale\("cta_cluster"\) needs a cluster launch'),
        (lambda: cluster_kernel((2, 1, 1), scope=False), RuntimeError,
         r'T\.copy destination reaches another block of the cluster: it must be inside '
         r'`with T\.Scale\("cta_cluster"\)`'),
        (lambda: cluster_kernel((2, 1, 1), dst_cta=2), IndexError,
         r"T\.copy destination 'tile': block 2 out of range for a cluster of 2 blocks"),
        (lambda: cluster_kernel((4, 4, 1), grid=(16, 4)), ValueError, r"clusters of 16 blocks; GPUs launch at most 8"),
        (lambda: cluster_kernel((4, 1, 1), grid=(6,)), ValueError,
         r"grid extent 6 along axis x is not a multiple of the cluster dimension 4"),
        (lambda: cluster_kernel((2, 1, 1), dst_global=True), TypeError,
         r"'A' is a global buffer; only shared-memory tiles"),
        (both_cta_sides, ValueError, r"got dst_cta, src_cta: one side of a copy is local"),
        (barrier_in_warpgroup, NotImplementedError, r'T\.barrier\(\) in T\.Scale\("warpgroup"\)'),
    ],
    ids=["no-cluster-launch", "outside-scope", "dst-cta-out-of-range", "cluster-too-large", "grid-not-multiple",
         "global-remote-side", "both-sides", "warpgroup-barrier"],
)
def test_bad_input_is_refused_at_build_time(build, error, pattern):
    with pytest.raises(error, match=pattern):
        build()


# --- the CPU path -------------------------------------------------------------------------------


CLUSTER_EXAMPLES = ["cluster_splitk_gemm", "cluster_shared_operand_gemm"]


@pytest.fixture(scope="module")
def cluster_examples() -> subprocess.CompletedProcess:
    """Both examples in one process on the CPU path (a world of one): Python starts once."""
    return run_python(RANKS / "run_examples.py", *CLUSTER_EXAMPLES, env={"TILESCALE_DEVICE": "cpu"}, timeout=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CLUSTER_EXAMPLES)
def test_examples_on_the_cpu_path(cluster_examples, name):
    proc = cluster_examples
    out = example_output(proc.stdout, None, name)
    assert out is not None and proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "correct" in out


@pytest.mark.timeout(200)
def test_cluster_semantics_on_the_cpu_path(tmp_path):
    """Ring exchange in clusters of 4 (puts and gets), barriers that order them, a rank
    computed at run time that is out of range, and TileLang's own cluster primitives."""
    script = tmp_path / "ring.py"
    script.write_text(textwrap.dedent("""
        import torch
        import tilescale as ts
        import tilescale.language as T

        @ts.jit
        def ring(blocks, modulus):
            @T.prim_func
            def main(Out: T.Tensor((blocks, 3, 8), "float32")):
                with T.Kernel(2, blocks // 2, threads=128, cluster_dims=(1, 4, 1)) as (bx, by):
                    mine = T.alloc_shared((8,), "float32")
                    got = T.alloc_shared((8,), "float32")
                    pulled = T.alloc_shared((8,), "float32")
                    with T.Scale("cta_cluster") as (cta, size):
                        for i in T.Parallel(8):
                            mine[i] = T.float32(100 * (by * 2 + bx) + cta * 10 + i)
                        T.barrier()
                        T.copy(mine, got, dst_cta=(cta + 1) % modulus)
                        T.copy(mine, pulled, src_cta=(cta + size - 1) % size)
                        T.barrier()
                        T.copy(got, Out[(by * 2 + bx), 0, :])
                        T.copy(pulled, Out[(by * 2 + bx), 1, :])
                        for i in T.Parallel(8):
                            Out[(by * 2 + bx), 2, i] = T.float32(T.block_rank_in_cluster())
                        T.cluster_sync()

            return main

        ts.init(device="cpu")
        out = torch.zeros(8, 3, 8)
        ring(8, 4)(out)
        # Blocks (bx, by); clusters are 4 consecutive by at fixed bx, rank = by % 4.
        for bx in range(2):
            for by in range(4):
                b, rank = by * 2 + bx, by % 4
                left = ((by // 4) * 4 + (rank - 1) % 4) * 2 + bx
                expect = torch.arange(8.0) + 100 * left + 10 * ((rank - 1) % 4)
                assert torch.equal(out[b, 0], expect), (b, out[b, 0], expect)
                assert torch.equal(out[b, 1], expect), (b, out[b, 1], expect)
                assert torch.equal(out[b, 2], torch.full((8,), float(rank)))
        print("RING-OK")
        try:
            ring(8, 6)(out)  # block 3 puts into block 4
        except IndexError as err:
            print("IndexError:", err)
    """))
    proc = run_python(script, env={"TILESCALE_DEVICE": "cpu"}, timeout=200, cwd=tmp_path)
    assert "RING-OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "IndexError: rank 0: block 4 of the cluster named for shared tile 'got' is out of range for a " \
           "cluster of 4 blocks (kernel line " in proc.stdout
    assert "ring.py:18)" in proc.stdout  # the line of the put, proc.stdout[-2000:] + proc.stderr[-3000:]
