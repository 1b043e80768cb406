"""The NVSHMEM backend and the NVSHMEM-call lowering, without a GPU.

What runs here: the backend registry and its errors (no nvshmem4py, no GPU, unreachable
peers), the lowering of remote operations to NVSHMEM device calls under
``build_options(remote="nvshmem")`` (the generated source calls the prelude's helpers on
this rank's symmetric addresses, with no peer tables), and, with nvcc and the pip NVSHMEM
package, that the generated source compiles relocatably and device-links against
``libnvshmem_device.a`` into an executable cubin. Running it needs GPUs (comm/README.md).

No ``from __future__ import annotations`` here: TileLang evaluates the kernels' annotations.
"""

import functools
import importlib.util
import re
import shutil
import subprocess
import sys

import pytest
from cuda_build import lower_cuda, needs_nvcc
from tvm import tirx

import tilescale.language as T
from tilescale import comm
from tilescale.comm.base import CommBackend
from tilescale.comm.group import Group
from tilescale.comm.nvshmem import NvshmemAllocation, NvshmemBackend
from tilescale.comm.nvshmem.loader import link_module
from tilescale.comm.nvshmem.lowering import NVSHMEM_LOWERING
from tilescale.jit import DistributedKernel
from tilescale.language import build_options

HAS_NVSHMEM_LIB = importlib.util.find_spec("nvidia.nvshmem") is not None
needs_nvshmem_lib = pytest.mark.skipif(not HAS_NVSHMEM_LIB, reason='needs pip "nvidia-nvshmem-cu13==3.4.5"')


# --- kernels ----------------------------------------------------------------------------------


def put_signal_wait_get_barrier(fused: bool = False):
    """Every remote operation once: put a shared tile, signal, wait, get it back, fence, barrier,
    and (``fused``) a put-with-signal through the NVSHMEM prelude's helper."""

    @T.prim_func
    def main(src: T.Tensor((64, 256), "bfloat16"), dst: T.Tensor((128, 256), "bfloat16"),
             flags: T.Tensor((8,), "int32"), sig: T.Tensor((8,), "uint64")):
        with T.Kernel(2, threads=128) as bx:
            with T.Scale("device") as (rank, world):
                tile = T.alloc_shared((64, 256), "bfloat16")
                T.copy(src, tile)
                T.copy(tile, dst[bx * 64, 0], dst_pe=(rank + 1) % world)
                T.signal(flags[bx], 1, pe=(rank + 1) % world, op="add")
                T.wait(flags[bx], "ge", 1)
                T.copy(dst[bx * 64, 0], tile, src_pe=(rank + world - 1) % world)
                T.fence()
                if fused:
                    T.call_extern("handle", "tilescale::nvshmem_put_signal_block", T.address_of(dst[bx * 64, 0]),
                                  T.address_of(tile[0, 0]), 512, T.address_of(sig[bx]), 1, 0, (rank + 1) % world)
                T.barrier()

    return main


def fragment_put():
    @T.prim_func
    def main(dst: T.Tensor((64, 64), "float32")):
        with T.Kernel(1, threads=128):
            with T.Scale("device") as (rank, world):
                acc = T.alloc_fragment((64, 64), "float32")
                T.clear(acc)
                T.copy(acc, dst, dst_pe=(rank + 1) % world)

    return main


def strided_put():
    @T.prim_func
    def main(src: T.Tensor((64, 64), "float32"), dst: T.Tensor((128, 128), "float32")):
        with T.Kernel(1, threads=128):
            with T.Scale("device") as (rank, world):
                tile = T.alloc_shared((64, 64), "float32")
                T.copy(src, tile)
                T.copy(tile, dst[0, 0], dst_pe=(rank + 1) % world)  # 64 of 128 columns: 64 separate runs

    return main


@functools.cache
def built(remote: str) -> tuple[tirx.PrimFunc, str]:
    with build_options(world_size=4, remote=remote):
        func = put_signal_wait_get_barrier(fused=remote == "nvshmem")
    return func, lower_cuda(func)


def kernel_body(src: str) -> str:
    return src[src.index('extern "C" __global__'):]


# --- 1. the backend registry and its errors --------------------------------------------------------


def test_nvshmem_is_a_registered_cuda_backend():
    with pytest.raises(ValueError, match="runs on cuda devices"):
        comm.check("nvshmem", "cpu")


def test_missing_nvshmem4py_is_named_before_anything_starts(monkeypatch):
    monkeypatch.setattr(comm, "_importable", lambda module: False)
    with pytest.raises(ImportError, match=r"tilescale\[nvshmem\]"):
        comm.check("nvshmem", "cuda")


def test_backend_without_nvshmem4py_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvshmem", None)  # import nvshmem.core then fails
    with pytest.raises(ImportError, match=r"pip install \"tilescale\[nvshmem\]\""):
        NvshmemBackend(group=None)


def test_backend_needs_a_gpu(monkeypatch):
    if importlib.util.find_spec("nvshmem") is None:
        pytest.skip("nvshmem4py not installed")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        NvshmemBackend(group=None)


def test_address_lowering_is_refused_when_a_peer_has_no_address():
    backend = object.__new__(NvshmemBackend)  # the checks need no NVSHMEM state
    backend.group = type("G", (), {"rank": 0})()
    backend.unreachable = []
    backend.check_lowering("address")
    backend.check_lowering("nvshmem")
    backend.unreachable = [2, 3]
    with pytest.raises(RuntimeError, match=r"ranks \[2, 3\].*build_options\(remote='nvshmem'\)"):
        backend.check_lowering("address")


def test_backends_without_nvshmem_refuse_nvshmem_kernels():
    class Plain(CommBackend):
        name = "cuda_ipc"

        def allocate(self, nbytes, tag):
            raise AssertionError

    with pytest.raises(RuntimeError, match="backend='nvshmem'"):
        Plain(None).check_lowering("nvshmem")


def test_unreachable_peer_copy_has_no_view():
    import torch

    local = torch.zeros(16, dtype=torch.uint8)
    dropped = []
    alloc = NvshmemAllocation(16, [None, local, None], [0, local.data_ptr(), 0], rank=1,
                              on_drop=lambda: dropped.append(True))
    assert alloc.peer_ptrs == [0, local.data_ptr(), 0] and alloc.nbytes == 16
    assert alloc.peer(1) is local
    with pytest.raises(RuntimeError, match="rank 2's copy is not load/store reachable"):
        alloc.peer(2)
    alloc.dropped()  # the tensor died: the backend hears of it
    assert dropped == [True]


# --- 2. lowering to NVSHMEM calls -------------------------------------------------------------------


def test_remote_operations_lower_to_the_nvshmem_helpers():
    func, src = built("nvshmem")
    body = kernel_body(src)
    assert str(func.attrs["tilescale.remote"]) == "nvshmem"
    # Remote sides are this rank's symmetric addresses and a peer's global rank (ts_pes: the
    # group's ranks): no peer tables but the barrier's.
    assert "__peers" not in body and "ts_sync_peers" in body
    bf16_tile = 64 * 256 * 2
    peer = r"ts_pes\[static_cast<int>\(\(\(\(\(int64_t\)ts_rank\) \+ \(int64_t\){}\) & \(int64_t\)3\)\)\]"
    next_pe, prev_pe = peer.format(1), peer.format(3)
    expected = [
        rf"{NVSHMEM_LOWERING.put}\(\(&\(dst\[.*\]\)\), \(&\(tile\[0\]\)\), {bf16_tile}, {next_pe}\)",
        rf"{NVSHMEM_LOWERING.signal}\(\(&\(flags\[.*\]\)\), 1, 1, {next_pe}\)",
        rf"{NVSHMEM_LOWERING.wait}\(\(&\(flags\[.*\]\)\), 2, 1, ts_status, ts_rank, ts_timeout_ns\)",
        rf"{NVSHMEM_LOWERING.get}\(\(&\(tile\[0\]\)\), \(&\(dst\[.*\]\)\), {bf16_tile}, {prev_pe}\)",
        rf"{NVSHMEM_LOWERING.fence}\(\)",
        r"tilescale::nvshmem_put_signal_block\(",
        rf"{NVSHMEM_LOWERING.barrier}\(ts_sync_peers, ts_rank, 4, ts_status, ts_timeout_ns, ts_pes\)",
    ]
    positions = []
    for pattern in expected:
        m = re.search(pattern, body)
        assert m, pattern
        positions.append(m.start())
    assert positions == sorted(positions), "calls out of program order"


def test_the_prelude_brings_the_nvshmem_device_calls():
    src = built("nvshmem")[1]
    prelude = src[:src.index('extern "C" __global__')]
    assert "#include <nvshmem.h>" in prelude and "#include <nvshmemx.h>" in prelude
    for call in ("nvshmemx_putmem_block", "nvshmemx_getmem_block", "nvshmemx_putmem_signal_nbi_block",
                 "nvshmem_int_atomic_add", "nvshmem_int_atomic_set", "nvshmem_int_test", "nvshmem_quiet"):
        assert call + "(" in prelude, call


def test_the_address_lowering_is_unchanged():
    func, src = built("address")
    assert "tilescale.remote" not in func.attrs
    assert "nvshmem" not in src
    assert "dst__peers" in kernel_body(src) and "flags__peers" in kernel_body(src)


def test_registers_are_staged_through_shared_memory():
    with build_options(world_size=2, remote="nvshmem"):
        body = kernel_body(lower_cuda(fragment_put()))
    stage = re.search(r"__shared__ __align__\(\d+\) float (\w+)\[\]", body).group(1)
    store = body.index(f"*(float4*)({stage} + ")  # the fragment written to the stage
    put = re.search(rf"{NVSHMEM_LOWERING.put}\(\(&\(dst\[0\]\)\), \(&\({stage}\[0\]\)\), 16384, ", body)
    assert put and store < put.start()


def test_a_strided_box_is_one_call_per_row():
    with build_options(world_size=2, remote="nvshmem"):
        body = kernel_body(lower_cuda(strided_put()))
    # 64 rows of 64 floats into rows of 128: 64 puts of 256 bytes (inside the peer's bounds check).
    assert re.search(r"for \(int (\w+) = 0; \1 < 64; \+\+\1\) \{(?:\s*if \([^\n]*\) \{)*\s*"
                     rf"{NVSHMEM_LOWERING.put}\(\(&\(dst\[\(\1 \* 128\)\]\)\), \(&\(tile\[\(\1 \* 64\)\]\)\), 256, ",
                     body), body


def column_major_put():
    @T.prim_func
    def main(dst: T.StridedTensor((64, 64), (1, 64), "float32")):
        with T.Kernel(1, threads=128):
            with T.Scale("device") as (rank, world):
                tile = T.alloc_shared((64, 64), "float32")
                T.clear(tile)
                T.copy(tile, dst, dst_pe=(rank + 1) % world)

    return main


def test_a_non_row_major_remote_side_is_refused():
    with build_options(world_size=2, remote="nvshmem"), pytest.raises(NotImplementedError, match="row-major"):
        column_major_put()


def test_unknown_remote_lowering():
    with pytest.raises(ValueError, match="remote must be one of"), build_options(remote="carrier-pigeon"):
        pass


def test_build_options_remote_nests_and_restores():
    with build_options(world_size=2, remote="nvshmem"):
        with build_options(world_size=4):
            assert str(put_signal_wait_get_barrier().attrs["tilescale.remote"]) == "nvshmem"
        with build_options(remote="address"):
            assert "tilescale.remote" not in put_signal_wait_get_barrier().attrs
    with build_options(world_size=2):
        assert "tilescale.remote" not in put_signal_wait_get_barrier().attrs


def test_the_backend_picks_peer_addresses_unless_a_peer_needs_calls(monkeypatch):
    backend = object.__new__(NvshmemBackend)
    backend.group = Group(0, 4, 0, 4, None, "job")
    backend.unreachable, backend.force_calls = [], False
    assert backend.kernel_lowering() == "address"
    backend.unreachable = [3]
    assert backend.kernel_lowering() == "nvshmem"
    backend.unreachable, backend.force_calls = [], True
    assert backend.kernel_lowering() == "nvshmem"
    # A group spanning nodes (2 of its 4 ranks on this one) gets the calls though all have addresses.
    backend.group, backend.force_calls = Group(0, 4, 0, 2, None, "job"), False
    assert backend.kernel_lowering() == "nvshmem"


def test_group_allocations_take_an_offset_free_on_every_member():
    """The NVSHMEM arena of process groups: the same heap offset on all of a group's ranks, disjoint
    from what each rank holds for its other groups, ranges merged again when their tensors die."""
    from tilescale.comm.nvshmem import GROUP_ALIGN, Arena, parse_size

    assert parse_size("256M") == 256 << 20 and parse_size("4G") == 4 << 30 and parse_size("1024") == 1024
    r0, r1, r2 = Arena(8 * GROUP_ALIGN), Arena(8 * GROUP_ALIGN), Arena(8 * GROUP_ALIGN)
    tp = Arena.first_fit([r0.free, r1.free], 3 * GROUP_ALIGN)          # group {0, 1}
    r0.take(tp, 3 * GROUP_ALIGN)
    r1.take(tp, 3 * GROUP_ALIGN)
    other = Arena.first_fit([r2.free], 100)                             # group {2, 3}: rank 2 from 0
    r2.take(other, 100)
    dp = Arena.first_fit([r0.free, r2.free], 2 * GROUP_ALIGN)          # group {0, 2}: free on both
    assert (tp, other, dp) == (0, 0, 3 * GROUP_ALIGN)
    r0.take(dp, 2 * GROUP_ALIGN)
    assert Arena.first_fit([r0.free, r1.free], 4 * GROUP_ALIGN) is None  # 3 left on rank 0
    # Dropped ranges (a tensor's finalizer, any moment) go back at the next allocation's free list;
    # a range dropped twice (its group released while its tensors died) goes back once.
    r0.drop(tp, 3 * GROUP_ALIGN)
    assert Arena.first_fit([r0.free, r1.free], 4 * GROUP_ALIGN) is None
    r0.drop(dp, 2 * GROUP_ALIGN)
    r0.drop(tp, 3 * GROUP_ALIGN)
    assert r0.free_ranges() == [[0, 8 * GROUP_ALIGN]] and r0.free_ranges() == [[0, 8 * GROUP_ALIGN]]


def test_nvshmem_kernels_need_a_gpu(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"run on CUDA GPUs.*backend='nvshmem'"):
        DistributedKernel(built("nvshmem")[0])


# --- 3. nvcc compiles and device-links against the pip NVSHMEM ---------------------------------------


@needs_nvcc
@needs_nvshmem_lib
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_link_module_builds_the_launcher_and_the_linked_cubin(tmp_path, monkeypatch):
    """What NvshmemKernel loads: TileLang's Python launcher and a cubin that is executable
    (``readelf``: EXEC) and leaves nothing of NVSHMEM's undefined."""
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    module = link_module(built("nvshmem")[0], "sm_90a")
    assert module.cubin.parent.parent == tmp_path / "tilescale-nvshmem"
    assert module.cubin.with_suffix(".py").read_text() == module.launcher
    # Hidden arguments follow the user's; the launcher passes all of them to the kernel.
    assert re.search(r"def call\(kernels, src, dst, flags, sig, ts_sync_peers, ts_pes, ts_rank, ts_status, "
                     r"ts_timeout_ns, stream=0\)", module.launcher)
    assert 'cuLaunchKernelEx(config, kernels["main_kernel"]' in module.launcher
    assert link_module(built("nvshmem")[0], "sm_90a").cubin == module.cubin  # cached by source
    data = module.cubin.read_bytes()
    assert data[:4] == b"\x7fELF"
    if shutil.which("readelf") is None:
        assert b"main_kernel" in data and b"nvshmemi_device_state_d" in data
        return
    header = subprocess.run(["readelf", "-hW", str(module.cubin)], capture_output=True, text=True, check=True).stdout
    assert "EXEC" in header  # linked: loadable with cuLibraryLoadData
    symbols = subprocess.run(["readelf", "-sW", str(module.cubin)], capture_output=True, text=True,
                             check=True).stdout
    defined, undefined = set(), set()
    for line in symbols.splitlines():
        fields = line.split()
        if len(fields) >= 8 and fields[4] == "GLOBAL":
            (undefined if fields[-2] == "UND" else defined).add(fields[-1])
    assert {"main_kernel", "nvshmemi_device_state_d"} <= defined  # the state nvshmemx_culibrary_init fills
    # Left to the driver: printf and the reserved shared memory; nothing of NVSHMEM's.
    assert undefined <= {"vprintf", ".nv.reservedSmem.offset0"}, undefined


def test_dynamic_dimensions_reach_the_launcher():
    """TileLang's Python launcher passes bare dynamic dimensions only; tilescale solves the
    ``n * c`` ones (the ops' vectorised sizes) from the arguments' shapes."""
    from tilescale.comm.nvshmem.loader import _shape_symbols

    @T.prim_func
    def main(src: T.Tensor((T.dynamic("n_vectors") * 8,), "bfloat16"), rows: T.Tensor((T.dynamic("m"), 4), "int32")):
        with T.Kernel(1, threads=128):
            T.evaluate(0)

    assert _shape_symbols(main) == {"n_vectors": ("int32", 0, 0, 8), "m": ("int32", 1, 0, 1)}

    @T.prim_func
    def shifted(src: T.Tensor((T.dynamic("k") + 1,), "bfloat16")):
        with T.Kernel(1, threads=128):
            T.evaluate(0)

    with pytest.raises(NotImplementedError, match=r"n or n \* c; got src dimension 0 \(k \+ 1\)"):
        _shape_symbols(shifted)


def test_a_tile_over_the_end_of_a_tensor_is_clipped():
    """As TileLang's copies skip what lies past a tensor's end, the NVSHMEM calls move only the
    part of the last tile that is inside (a call of 0 bytes does nothing)."""

    def build():
        n = T.dynamic("n")

        @T.prim_func
        def main(src: T.Tensor((n,), "float32"), dst: T.Tensor((n,), "float32")):
            with T.Kernel(4, threads=128) as bx:
                with T.Scale("device") as (rank, world):
                    T.copy(src[bx * 1024:bx * 1024 + 1024], dst[bx * 1024:bx * 1024 + 1024],
                           dst_pe=(rank + 1) % world)

        return main

    with build_options(world_size=2, remote="nvshmem"):
        body = kernel_body(lower_cuda(build()))
    assert re.search(rf"{NVSHMEM_LOWERING.put}\(.*, \(max\(min\(\(n - \(\(\(int\)blockIdx.x\) \* 1024\)\), 1024\), 0\) "
                     r"\* 4\), ", body), body


def test_the_mpi_bootstrap_is_refused_under_an_mpi_it_was_not_built_for():
    mpi = pytest.importorskip("mpi4py.MPI")
    from tilescale.comm.nvshmem import check_mpi_bootstrap

    if "Open MPI" in mpi.Get_library_version():
        check_mpi_bootstrap(1)
        # A job this MPI did not start (another launcher's ranks): each process is an MPI job of one.
        with pytest.raises(RuntimeError, match=r"sees 1 process\(es\), but the job has 2 ranks"):
            check_mpi_bootstrap(2)
    else:  # MPICH (the tilescale[mpi] extra): NVSHMEM's plugin needs libmpi.so.40
        with pytest.raises(RuntimeError, match=r"built against Open MPI .*leave TILESCALE_NVSHMEM_BOOTSTRAP unset"):
            check_mpi_bootstrap(2)


def _op_kernels():
    from tilescale.ops import collectives, moe, p2p, tp_gemm
    from tilescale.ops._gemm import DEFAULT, NARROW, WIDE, swapped_tile

    no_ws = {"tl.disable_warp_specialized": True}
    return {
        "all_gather": (collectives.all_gather_kernel, (2, "bfloat16", 8, 132), None),
        "reduce_scatter": (collectives.reduce_kernel, (2, "bfloat16", 8, 132, "scatter"), None),
        "all_reduce_two_shot": (collectives.reduce_kernel, (2, "bfloat16", 8, 132, "push"), None),
        "put": (p2p.transfer_kernel, ("bfloat16", 8, p2p.DEFAULT_PLAN, 132, False), None),
        "get": (p2p.transfer_kernel, ("bfloat16", 8, p2p.DEFAULT_PLAN, 132, True), None),
        "moe_dispatch": (moe.dispatch_kernel, (2, 64, 256, 4, 8, 1536, "bfloat16", 132, False), None),
        "moe_dispatch_low_latency": (moe.dispatch_kernel, (2, 64, 256, 4, 8, 1536, "bfloat16", 132, True), None),
        "moe_dispatch_in_place": (moe.dispatch_kernel, (2, 64, 256, 4, 8, 1536, "bfloat16", 132, False, True), None),
        # A decode batch routed by the dispatch kernel itself (int64 ids as passed).
        "moe_dispatch_low_latency_routed": (moe.dispatch_kernel,
                                            (2, 64, 256, 4, 8, 1536, "bfloat16", 132, True, False, 2, "int64"), None),
        # FP8 rows as the dispatch moves them: 256 channels packed with their scales into 264 bytes.
        "moe_dispatch_fp8": (moe.dispatch_kernel, (2, 64, 264, 2, 8, 1536, "uint8", 132, False), None),
        "moe_dispatch_fp8_low_latency": (moe.dispatch_kernel, (2, 64, 264, 2, 8, 1536, "uint8", 132, True), None),
        "moe_combine": (moe.combine_kernel, (2, 64, 256, 4, 1024, "bfloat16", 132), None),
        "ag_gemm": (tp_gemm.ag_own_gemm_kernel, (2, "bfloat16", 256, 256, 512, 512, 16, DEFAULT), None),
        "ag_gemm_wide": (tp_gemm.ag_own_gemm_kernel, (2, "bfloat16", 256, 256, 512, 512, 16, WIDE), None),
        "gemm_rs_in_gemm": (tp_gemm.gemm_reduce_scatter_kernel, (2, "bfloat16", 512, 512, 512, DEFAULT, 1), no_ws),
        # As link_module builds it: no warp specialisation under this lowering.
        "gemm_rs": (tp_gemm.gemm_push_kernel, (2, "bfloat16", 512, 512, 512, 2, DEFAULT, 1),
                    no_ws),
        "gemm_all_reduce_one_kernel": (tp_gemm.all_reduce_gemm_kernel, (2, "bfloat16", 128, 512, 1024, NARROW),
                                       no_ws),
        # The decode batch in the wgmma's N (33 rows in a 48-row tile), slots laid out for 256 rows.
        "gemm_all_reduce_one_kernel_swapped": (tp_gemm.all_reduce_gemm_kernel,
                                               (2, "bfloat16", 48, 512, 1024, swapped_tile(33), 1, 256), no_ws),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_op_kernels()))
def test_every_op_kernel_lowers_to_nvshmem_calls(name):
    """What TILESCALE_NVSHMEM_CALLS=1 (or a peer on another node) builds: each op's remote
    operations as NVSHMEM helpers, no peer tables but the barrier's."""
    factory, args, configs = _op_kernels()[name]
    with build_options(world_size=2, remote="nvshmem"):
        body = kernel_body(lower_cuda(factory.__wrapped__(*args), configs))
    assert re.search(r"tilescale::nvshmem_(put|get)_block\(", body), body[:3000]
    assert "__peers" not in body.replace("ts_sync_peers", "")
    if name.startswith("gemm_all_reduce_one_kernel"):  # signals and waits per warp, through NVSHMEM's helpers too
        assert "tilescale::nvshmem_warp_signal(" in body and "tilescale::nvshmem_warp_wait(" in body


def test_kernels_without_a_dynamic_shared_buffer_are_left_alone():
    from tilescale.comm.nvshmem.loader import align_dynamic_shared

    _, src = built("nvshmem")
    assert "buf_dyn_shmem" not in src
    assert align_dynamic_shared(src) == (src, 0)
    two = ("extern __shared__ __align__(1024) uchar buf_dyn_shmem[];\n"
           "extern __shared__ __align__(128) uchar buf_dyn_shmem[];")
    aligned, slack = align_dynamic_shared(two)
    assert slack == 1024 and aligned.count("uchar* buf_dyn_shmem = ts_dyn_shmem_base") == 2
    assert "% 128u)) % 128u);" in aligned  # each kernel keeps its own alignment


@needs_nvcc
@needs_nvshmem_lib
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_dynamic_shared_buffer_is_realigned_after_the_device_link(tmp_path, monkeypatch):
    """The device link drops the 1024-byte alignment of TileLang's dynamic shared buffer and
    puts NVSHMEM's static shared memory before it (a TMA GEMM then faults with a misaligned
    address): the kernel aligns the buffer itself, in an allocation one alignment larger."""
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    factory, args, configs = _op_kernels()["ag_gemm"]
    with build_options(world_size=2, remote="nvshmem"):
        func = factory.__wrapped__(*args)
    plain = kernel_body(lower_cuda(func, configs))
    assert "extern __shared__ __align__(1024) uchar buf_dyn_shmem[];" in plain
    module = link_module(func, "sm_90a")
    assert "uchar buf_dyn_shmem[]" not in module.source
    # and without warp specialisation (its launch faulted once device-linked)
    assert "warpgroup_reg_alloc" in plain and "warpgroup_reg_alloc" not in module.source
    assert re.search(r"uchar\* buf_dyn_shmem = ts_dyn_shmem_base \+ \(\(1024u - .*% 1024u\)\) % 1024u\);",
                     module.source)
    requested = {int(n) for n in re.findall(r"config\.sharedMemBytes = (\d+)", module.launcher)}
    allowed = {int(n) for n in re.findall(r"MAX_DYNAMIC_SHARED_SIZE_BYTES,\s*(\d+)", module.launcher)}
    (dynamic,) = requested
    assert allowed == requested and dynamic % 1024 == 0 and dynamic > 1024  # the tiles' bytes + 1024
    if shutil.which("readelf") is not None:  # why: the linked kernel's shared memory keeps 16-byte alignment
        sections = subprocess.run(["readelf", "-SW", str(module.cubin)], capture_output=True, text=True,
                                  check=True).stdout
        (line,) = [line for line in sections.splitlines() if ".nv.shared.main_kernel" in line]
        assert int(line.split()[-1]) < 1024, line
