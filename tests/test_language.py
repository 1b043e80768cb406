"""The tilescale language without a GPU: what distributed kernels lower to, and what is refused.

Every kernel here is built for a fixed world size (``build_options``) and lowered to CUDA C++
for sm_90a on the CPU; the tests read the PrimFunc (hidden parameters, their order, the world
size) and the generated source (peer-table loads and the order peers are visited in, remote
stores through the loaded pointers, signal/wait/barrier calls, the system-scope PTX of the
prelude). A few sources go through nvcc; a subprocess with a one-rank CPU runtime checks the
jit's argument checks, which happen before any launch.

No ``from __future__ import annotations`` here: TileLang evaluates the kernels' annotations.
"""

import functools
import keyword
import re
import runpy
import textwrap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import tilelang.language as TL
from cpu_jobs import RANKS, run_python
from cuda_build import TARGET, lower_cuda, needs_nvcc, nvcc
from shared_kernels import gemm, handshake, push
from tvm import tirx

import tilescale.language as T
from tilescale import runtime
from tilescale.jit import DistributedKernel, _user_params
from tilescale.language import build_options
from tilescale.language.sync import PRELUDE
from tilescale.ops.collectives import all_gather_kernel, reduce_kernel
from tilescale.ops.p2p import DEFAULT_PLAN, CopyPlan, transfer_kernel

ROOT = Path(__file__).resolve().parent.parent
SCALARS = ("ts_rank", "ts_status", "ts_timeout_ns")
SYSTEM_SCOPE_PTX = (
    "red.release.sys.global.add.s32",
    "st.release.sys.global.s32",
    "ld.acquire.sys.global.s32",
    "fence.acq_rel.sys",
    "cp.async.bulk.wait_group 0",
    "%globaltimer",
)
lower = lower_cuda


# --- kernels ----------------------------------------------------------------------------------


@functools.cache
def ring_shift_factory() -> Callable[..., tirx.PrimFunc]:
    """The undecorated kernel factory of examples/ring_shift.py (its main() does not run)."""
    return runpy.run_path(str(ROOT / "examples" / "ring_shift.py"), run_name="ring_shift_example")[
        "ring_shift"
    ].__wrapped__


def put_fence_signal_wait_barrier():
    """Every synchronisation operation: put, fence, signal (add) to a peer, wait, signal (set) locally, barrier."""

    @T.prim_func
    def main(src: T.Tensor((1024,), "float32"), dst: T.Tensor((1024,), "float32"),
             flags: T.Tensor((8,), "int32")):
        with T.Kernel(1, threads=128):
            with T.Scale("device") as (rank, world):
                T.copy(src, dst, dst_pe=(rank + 1) % world)
                T.fence()
                T.signal(flags[rank], 1, pe=(rank + 1) % world, op="add")
                T.wait(flags[2], "gt", 7)
                T.signal(flags[3], 5)  # this rank's own flag, op "set"
                T.barrier()

    return main


def right(r: int, p: int, w: int) -> int:  # push order: the right neighbour first, self last
    return (r + 1 + p) % w


def own_first(r: int, p: int, w: int) -> int:  # pull order: self first, then the right neighbours
    return (r + p) % w


@dataclass(frozen=True)
class Spec:
    build: Callable[[int], tirx.PrimFunc]  # called inside build_options(world_size=world)
    tables: dict[str, str]  # peer table -> the argument it holds addresses of, in parameter order
    sync: bool  # uses T.barrier(): the barrier workspace's peer table
    scalars: tuple[str, ...]
    barriers: int
    signals: int
    waits: int
    visits: tuple  # per peer-table load, in source order: (table, peer(rank, p, world)) or (table, "peer")
    writes: bool  # stores through a peer's pointer
    reads: bool  # loads through a peer's pointer
    agrees: int = 0  # T.agree calls (a barrier that also compares the ranks' call signatures)


# Each collective opens with T.agree and closes with T.barrier().
COLLECTIVE = dict(sync=True, scalars=SCALARS, barriers=1, signals=0, waits=0, agrees=1)

KERNELS = {
    "ring_shift": Spec(
        lambda w: ring_shift_factory()(512, 256, 32), {"B__peers": "B"}, True, SCALARS, 1, 0, 0,
        (("B__peers", lambda r, p, w: (r + 1) % w),), writes=True, reads=False,
    ),
    "all_gather": Spec(
        lambda w: all_gather_kernel.__wrapped__(w, "bfloat16", 8, 132), {"out__peers": "out"}, **COLLECTIVE,
        visits=(("out__peers", right),), writes=True, reads=False,
    ),
    "reduce_scatter": Spec(
        lambda w: reduce_kernel.__wrapped__(w, "bfloat16", 8, 132, "scatter"), {"src__peers": "src"},
        **COLLECTIVE, visits=(("src__peers", own_first),), writes=False, reads=True,
    ),
    "reduce_two_shot": Spec(
        lambda w: reduce_kernel.__wrapped__(w, "bfloat16", 8, 132, "push"), {"src__peers": "src"},
        **COLLECTIVE, visits=(("src__peers", own_first), ("src__peers", right)), writes=True, reads=True,
    ),
    "reduce_one_row": Spec(
        lambda w: reduce_kernel.__wrapped__(1, "float32", 4, 132, "local"), {"src__peers": "src"},
        **COLLECTIVE, visits=(("src__peers", own_first),), writes=False, reads=True,
    ),
    "put": Spec(
        lambda w: transfer_kernel.__wrapped__("bfloat16", 8, DEFAULT_PLAN, 132, False), {"dst__peers": "dst"},
        False, (), 0, 0, 0, (("dst__peers", "peer"),), writes=True, reads=False,
    ),
    "get": Spec(
        lambda w: transfer_kernel.__wrapped__("bfloat16", 8, DEFAULT_PLAN, 132, True), {"src__peers": "src"},
        False, (), 0, 0, 0, (("src__peers", "peer"),), writes=False, reads=True,
    ),
    "put_staged": Spec(
        lambda w: transfer_kernel.__wrapped__("float16", 8, CopyPlan(), 132, False), {"dst__peers": "dst"},
        False, (), 0, 0, 0, (("dst__peers", "peer"),), writes=True, reads=False,
    ),
    "get_staged": Spec(
        lambda w: transfer_kernel.__wrapped__("float16", 8, CopyPlan(), 132, True), {"src__peers": "src"},
        False, (), 0, 0, 0, (("src__peers", "peer"),), writes=False, reads=True,
    ),
    "handshake": Spec(
        lambda w: handshake(1), {"flags__peers": "flags"}, False, SCALARS, 0, 1, 1,
        (("flags__peers", lambda r, p, w: (r + 1) % w),), writes=True, reads=False,
    ),
    "put_fence_signal_wait_barrier": Spec(
        lambda w: put_fence_signal_wait_barrier(), {"dst__peers": "dst", "flags__peers": "flags"}, True, SCALARS,
        1, 2, 1, (("dst__peers", lambda r, p, w: (r + 1) % w), ("flags__peers", lambda r, p, w: (r + 1) % w)),
        writes=True, reads=False,
    ),
}
CASES = [(name, world) for name in KERNELS for world in (2, 4)]


@functools.cache
def built(name: str, world: int) -> tuple[tirx.PrimFunc, str]:
    """The kernel's PrimFunc for ``world`` ranks and its CUDA source (cached across tests)."""
    with build_options(world_size=world):
        func = KERNELS[name].build(world)
    return func, lower(func)


def param_names(func: tirx.PrimFunc) -> list[str]:
    return [func.buffer_map[p].name if p in func.buffer_map else p.name for p in func.params]


def hidden_of(func: tirx.PrimFunc) -> dict[str, str]:
    """``tilescale.hidden`` as DistributedKernel reads it (its order is the binding order)."""
    return {str(k): str(v) for k, v in dict(func.attrs["tilescale.hidden"]).items()}


def kernel_body(src: str) -> str:
    """The definition of the generated __global__ function (after the prelude and its declaration)."""
    start = src.index("__global__ void __launch_bounds__")
    return src[start:]


def table_loads(src: str) -> list[tuple[str, str]]:
    """(peer table, index expression) of every ``X__peers[...]`` in the kernel body, in order."""
    body = kernel_body(src)
    loads = []
    for m in re.finditer(r"\b(\w+__peers)\[", body):
        depth, i = 1, m.end()
        while depth:
            depth += {"[": 1, "]": -1}.get(body[i], 0)
            i += 1
        loads.append((m.group(1), body[m.end():i - 1]))
    return loads


def evaluate(index: str, **names: int) -> int:
    """An index expression of the generated C (ints, + % & >> and parentheses) in Python."""
    assert re.fullmatch(r"[\w\s()+\-*%&|>]+", index), index
    return eval(index, {"__builtins__": {}}, names)  # noqa: S307 - checked to be arithmetic above


def remote_pointers(src: str) -> list[str]:
    """Variables holding a peer's address as a pointer: ``void* v = (*(void* *)(&(v_)));``."""
    return re.findall(r"void\* (\w+) = \(\*\(void\* \*\)\(&\(\w+\)\)\);", kernel_body(src))


def stores_through(src: str, ptr: str) -> bool:
    body = kernel_body(src)
    typed = rf"\(\(\w+\*\){ptr}\)"
    return bool(
        re.search(rf"(?m)^\s*\*\(\w+\*\)\({typed}", body)  # vector store: *(uint4*)(((T*)v) + i) = ...
        or re.search(rf"tl::tma_store\(\(&\({typed}\[", body)  # bulk store into the peer
        or re.search(rf"tilescale::block_signal\(\(&\({typed}\[", body)  # flag of the peer
    )


def loads_through(src: str, ptr: str) -> bool:
    return bool(re.search(rf"= \*\(\w+\*\)\(\(\(\w+\*\){ptr}\)", kernel_body(src)))


# --- 1. lowering of distributed kernels ---------------------------------------------------------


@pytest.mark.parametrize(("name", "world"), CASES)
def test_hidden_params_are_appended_after_the_users_in_binding_order(name, world):
    spec = KERNELS[name]
    func, _ = built(name, world)
    hidden = hidden_of(func)
    expected = [*spec.tables, *(["ts_sync_peers"] if spec.sync else []), *spec.scalars]
    assert list(hidden) == expected
    assert {k: v for k, v in hidden.items() if v} == spec.tables  # tables name their argument
    assert all(hidden[k] == "" for k in expected if k not in spec.tables)
    assert int(func.attrs["tilescale.world_size"]) == world
    # The jit binds hidden values in the attribute's order after the user's arguments: that
    # must be the order of the parameters appended to the PrimFunc.
    names = param_names(func)
    assert names[len(names) - len(hidden):] == list(hidden)
    assert _user_params(func, hidden) == names[: len(names) - len(hidden)]
    assert set(spec.tables.values()) <= set(names)
    for p in func.params[len(names) - len(hidden):]:
        if p in func.buffer_map:  # a peer-address table: one int64 per rank
            table = func.buffer_map[p]
            assert str(table.dtype) == "int64" and [int(d) for d in table.shape] == [world]
        else:
            assert str(p.dtype) == ("int32" if p.name == "ts_rank" else "int64")


@pytest.mark.parametrize(("name", "world"), CASES)
def test_source_signature_calls_and_no_placeholders(name, world):
    spec = KERNELS[name]
    _, src = built(name, world)
    signature = kernel_body(src).split("{", 1)[0]
    for table in spec.tables:
        assert f"const int64_t* __restrict__ {table}" in signature
    if spec.sync:
        assert "const int64_t* __restrict__ ts_sync_peers" in signature
    if spec.scalars:
        assert "int ts_rank" in signature
        assert "int64_t ts_status" in signature and "int64_t ts_timeout_ns" in signature
    else:
        assert "ts_rank" not in signature and "ts_status" not in signature
    body = kernel_body(src)
    barrier = f"tilescale::grid_barrier(ts_sync_peers, ts_rank, {world}, ts_status, ts_timeout_ns);"
    assert body.count("tilescale::grid_barrier(") == body.count(barrier) == spec.barriers
    agree = f"tilescale::grid_agree(ts_sync_peers, ts_rank, {world}, ts_status, ts_timeout_ns, sig);"
    assert body.count("tilescale::grid_agree(") == body.count(agree) == spec.agrees
    assert body.count("tilescale::block_signal(") == spec.signals
    assert body.count("tilescale::block_wait(") == spec.waits
    for leftover in ("call_extern", "tirx", "T.", "address_of", "tvm_", "None", "<undefined>"):
        assert leftover not in body, leftover
    assert "namespace tilescale" in src and "main_kernel" in body


@pytest.mark.parametrize(("name", "world"), CASES)
def test_peers_come_from_the_table_in_staggered_order(name, world):
    spec = KERNELS[name]
    _, src = built(name, world)
    loads = table_loads(src)
    assert [t for t, _ in loads] == [t for t, _ in spec.visits]
    for (table, index), (_, visit) in zip(loads, spec.visits, strict=True):
        if visit == "peer":  # put/get: the peer is an argument, bounds-checked before the load
            assert index == "((int64_t)peer)"
            assert f"(peer < {world}) && (0 <= peer)" in kernel_body(src)
            continue
        assert "ts_rank" in index, f"{table}[{index}] does not depend on the rank"
        loop_vars = set(re.findall(r"[A-Za-z_]\w*", index)) - {"ts_rank"}
        assert len(loop_vars) <= 1 and not any(keyword.iskeyword(v) for v in loop_vars), index
        if not loop_vars:
            for r in range(world):
                assert evaluate(index, ts_rank=r) == visit(r, 0, world), (index, r)
            continue
        (p,) = loop_vars
        assert re.search(rf"for \(int {p} = 0; {p} < {world}; \+\+{p}\)", src), f"loop over {p} is not 0..{world}"
        for r in range(world):
            order = [evaluate(index, ts_rank=r, **{p: i}) for i in range(world)]
            assert order == [visit(r, i, world) for i in range(world)], (index, r)
            assert sorted(order) == list(range(world))  # every rank exactly once


@pytest.mark.parametrize(("name", "world"), CASES)
def test_remote_accesses_go_through_pointers_loaded_from_the_table(name, world):
    spec = KERNELS[name]
    _, src = built(name, world)
    pointers = remote_pointers(src)
    assert len(pointers) == len(spec.visits)
    assert any(stores_through(src, v) for v in pointers) == spec.writes
    assert any(loads_through(src, v) for v in pointers) == spec.reads


def test_ring_shift_stores_its_tile_into_the_right_neighbour_with_a_bulk_copy():
    _, src = built("ring_shift", 4)
    body = kernel_body(src)
    assert "int64_t v_ = B__peers[((ts_rank + 1) & 3)];" in body
    store = re.search(r"tl::tma_store\(\(&\(\(\(bfloat16_t\*\)v\)\[.*\]\)\), \(&\(tile\[0\]\)\), (\d+)\);", body)
    assert store and int(store.group(1)) == 32 * 256 * 2  # one block's rows, bytes
    assert body.index("tl::tma_store_wait") < body.index("tilescale::grid_barrier(")


def test_signal_and_wait_arguments():
    _, src = built("handshake", 4)
    body = kernel_body(src)
    assert "if (ts_rank != 1) {" in body
    assert "int64_t v_ = flags__peers[((ts_rank + 1) & 3)];" in body
    assert "tilescale::block_signal((&(((int*)v)[1])), 1, 0);" in body  # op "set"
    # The wait polls this rank's own flag (not through the table): "ge" is comparison 2.
    assert "tilescale::block_wait((&(flags[1])), 2, 1, ts_status, ts_rank, ts_timeout_ns);" in body

    _, src = built("put_fence_signal_wait_barrier", 2)
    body = kernel_body(src)
    assert "tilescale::block_signal((&(((int*)v_1)[ts_rank])), 1, 1);" in body  # op "add"
    assert "tilescale::block_wait((&(flags[2])), 3, 7, ts_status, ts_rank, ts_timeout_ns);" in body  # "gt"
    assert "tilescale::block_signal((&(flags[3])), 5, 0);" in body  # pe=None: this rank's flag, op "set"
    order = [body.index(s) for s in ("dst__peers[", "tilescale::block_fence();", "tilescale::block_signal((&(((",
                                     "tilescale::block_wait(", "tilescale::block_signal((&(flags[3]",
                                     "tilescale::grid_barrier(")]
    assert order == sorted(order)


def test_warp_scope_wait_lowers_to_a_per_warp_spin():
    """Lane 0 of each warp that runs it spins on this rank's flag; no block-wide synchronisation."""
    with build_options(world_size=2):
        @T.prim_func
        def main(flags: T.Tensor((4,), "int32"), out: T.Tensor((128,), "int32")):
            with T.Kernel(1, threads=128):
                with T.Scale("device"):
                    T.wait(flags[2], "eq", 3, scope="warp")
                    for i in T.Parallel(128):
                        out[i] = flags[2]

    body = kernel_body(lower_cuda(main))
    assert "tilescale::warp_wait((&(flags[2])), 0, 3, ts_status, ts_rank, ts_timeout_ns);" in body
    assert "block_wait" not in body
    helper = PRELUDE[PRELUDE.index("void warp_wait("):]
    helper = helper[:helper.index("}\n")]
    assert "if ((threadIdx.x & 31) == 0) spin<true>(addr, cmp, expected" in helper
    assert helper.index("spin<true>") < helper.index("__syncwarp();") < helper.index("after_acquire();")


@pytest.mark.parametrize("name", ["ring_shift", "all_gather", "reduce_two_shot", "handshake", "put"])
def test_prelude_has_the_system_scope_ptx(name):
    _, src = built(name, 4)
    assert src.count("namespace tilescale {") == 1
    assert src.index("namespace tilescale {") < src.index("__global__")
    for ptx in SYSTEM_SCOPE_PTX:
        assert ptx in src, ptx
    for helper in ("block_signal(int* addr", "block_wait(const int* addr", "grid_barrier(const void* peer_table"):
        assert helper in src


@pytest.mark.parametrize("world", [3, 5])
def test_staggered_order_with_a_world_that_is_not_a_power_of_two(world):
    with build_options(world_size=world):
        gather = all_gather_kernel.__wrapped__(world, "float16", 8, 132)
        two_shot = reduce_kernel.__wrapped__(world, "float16", 8, 132, "push")
    for func, visits in ((gather, [right]), (two_shot, [own_first, right])):
        loads = table_loads(lower(func))
        assert len(loads) == len(visits)
        for (_, index), visit in zip(loads, visits, strict=True):
            (p,) = set(re.findall(r"[A-Za-z_]\w*", index)) - {"ts_rank"}
            for r in range(world):
                assert [evaluate(index, ts_rank=r, **{p: i}) for i in range(world)] == [
                    visit(r, i, world) for i in range(world)
                ], (index, r)


def test_many_symmetric_arguments_keep_their_order():
    """Six peer tables, the barrier workspace and three scalars: more than a small map holds."""

    def many():
        @T.prim_func
        def main(A: T.Tensor((128,), "float32"), Z: T.Tensor((128,), "float32"), M: T.Tensor((128,), "float32"),
                 C: T.Tensor((128,), "float32"), B: T.Tensor((128,), "float32"), Y: T.Tensor((128,), "float32"),
                 fl: T.Tensor((4,), "int32")):
            with T.Kernel(1, threads=128):
                with T.Scale("device") as (rank, world):
                    T.copy(A, Z, dst_pe=(rank + 1) % world)
                    T.copy(A, M, dst_pe=(rank + 2) % world)
                    T.copy(A, C, dst_pe=(rank + 3) % world)
                    T.copy(B, A, src_pe=(rank + 1) % world)
                    T.copy(Y, A, src_pe=0)
                    T.copy(Y, A, src_pe=1)  # the same table again
                    T.signal(fl[0], 1, pe=1, op="add")
                    T.wait(fl[0], "ge", 1)
                    T.barrier()

        return main

    with build_options(world_size=4):
        func = many()
    hidden = hidden_of(func)
    tables = ["Z__peers", "M__peers", "C__peers", "B__peers", "Y__peers", "fl__peers"]
    assert list(hidden) == [*tables, "ts_sync_peers", *SCALARS]
    names = param_names(func)
    assert names == ["A", "Z", "M", "C", "B", "Y", "fl", *hidden]
    src = lower(func)
    assert [t for t, _ in table_loads(src)] == ["Z__peers", "M__peers", "C__peers", "B__peers", "Y__peers",
                                                 "Y__peers", "fl__peers"]
    assert "fl__peers[1]" in src and "Y__peers[0]" in src


# --- 2. single-GPU programs are TileLang programs -------------------------------------------------


def tile_copy(lang):
    @lang.prim_func
    def main(A: lang.Tensor((256, 128), "float16"), B: lang.Tensor((256, 128), "float16")):
        with lang.Kernel(4, threads=128) as bx:
            tile = lang.alloc_shared((64, 128), "float16")
            lang.copy(A[bx * 64, 0], tile)
            lang.copy(tile, B[bx * 64, 0])

    return main


@pytest.mark.parametrize("program", [tile_copy, gemm])
def test_single_gpu_program_lowers_as_with_tilelang(program):
    reference = program(TL)
    with build_options(world_size=4):
        func = program(T)
    assert "tilescale.hidden" not in func.attrs and "tilescale.world_size" not in func.attrs
    assert param_names(func) == param_names(reference)
    src, ref_src = lower(func), lower(reference)
    # tilescale's T.Kernel only puts its (unused) device helpers in front of TileLang's source.
    assert src == PRELUDE + ref_src
    assert "__peers" not in ref_src and "ts_rank" not in src
    if program is gemm:
        assert "tl::gemm" in ref_src or "wgmma" in ref_src


def test_single_gpu_program_builds_without_init_or_build_options(monkeypatch):
    monkeypatch.setattr(runtime, "_runtime", None)
    func = tile_copy(T)
    assert "tilescale.hidden" not in func.attrs
    assert lower(func) == PRELUDE + lower(tile_copy(TL))


# --- 3. nvcc compiles the generated sources --------------------------------------------------------


@needs_nvcc
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_nvcc_compiles_generated_sources(tmp_path):
    jobs = [("ring_shift", 2, "cubin"), ("all_gather", 4, "cubin"), ("reduce_two_shot", 4, "cubin"),
            ("handshake", 4, "cubin"), ("put_fence_signal_wait_barrier", 2, "ptx")]
    sources = {(name, world): built(name, world)[1] for name, world, _ in jobs}
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda j: nvcc(sources[j[0], j[1]], tmp_path / f"{j[0]}_{j[1]}.{j[2]}", j[2]), jobs))
    for (name, world, kind), result in zip(jobs, results, strict=True):
        assert result.returncode == 0, f"{name} (world {world}):\n{result.stderr[-3000:]}"
        out = (tmp_path / f"{name}_{world}.{kind}").read_bytes()
        if kind == "cubin":
            assert out[:4] == b"\x7fELF" and b"main_kernel" in out
    # The PTX keeps the system-scope synchronisation the prelude writes in inline assembly.
    ptx = (tmp_path / "put_fence_signal_wait_barrier_2.ptx").read_text()
    assert ".entry main_kernel" in ptx and ".target sm_90a" in ptx
    for instruction in SYSTEM_SCOPE_PTX:
        assert instruction in ptx, instruction


# --- 4. API errors at build time -----------------------------------------------------------------


def remote_peer_out_of_range():
    @T.prim_func
    def main(A: T.Tensor((128, 128), "float16"), B: T.Tensor((128, 128), "float16")):
        with T.Kernel(2, threads=128) as bx:
            tile = T.alloc_shared((64, 128), "float16")
            T.copy(A[bx * 64, 0], tile)
            T.copy(tile, B[0, 0], dst_pe=5)

    return main


def remote_source_out_of_range():
    @T.prim_func
    def main(A: T.Tensor((128, 128), "float16"), B: T.Tensor((128, 128), "float16")):
        with T.Kernel(2, threads=128) as bx:
            tile = T.alloc_shared((64, 128), "float16")
            T.copy(A[bx * 64, 0], tile, src_pe=-1)

    return main


def remote_into_shared():
    @T.prim_func
    def main(A: T.Tensor((128, 128), "float16")):
        with T.Kernel(2, threads=128) as bx:
            tile = T.alloc_shared((64, 128), "float16")
            T.copy(A[bx * 64, 0], tile, dst_pe=1)

    return main


def remote_into_fragment():
    @T.prim_func
    def main(A: T.Tensor((128, 128), "float16")):
        with T.Kernel(2, threads=128) as bx:
            tile = T.alloc_fragment((64, 128), "float16")
            T.copy(A[bx * 64, 0], tile, dst_pe=1)

    return main


def remote_both_sides():
    @T.prim_func
    def main(A: T.Tensor((128, 128), "float16"), B: T.Tensor((128, 128), "float16")):
        with T.Kernel(2, threads=128) as bx:
            T.copy(A[bx * 64, 0], B[bx * 64, 0], dst_pe=1, src_pe=1)

    return main


def barrier_outside_scale():
    @T.prim_func
    def main(A: T.Tensor((128,), "float16")):
        with T.Kernel(2, threads=128):
            T.barrier()

    return main


def unknown_scale():
    @T.prim_func
    def main(A: T.Tensor((128,), "float16")):
        with T.Kernel(2, threads=128):
            with T.Scale("galaxy"):
                T.barrier()

    return main


def float_flag():
    @T.prim_func
    def main(flags: T.Tensor((128,), "float32")):
        with T.Kernel(1, threads=128):
            with T.Scale("device"):
                T.signal(flags[0], 1)

    return main


def unknown_comparison():
    @T.prim_func
    def main(flags: T.Tensor((128,), "int32")):
        with T.Kernel(1, threads=128):
            with T.Scale("device"):
                T.wait(flags[0], "approx", 1)

    return main


def unknown_signal_op():
    @T.prim_func
    def main(flags: T.Tensor((128,), "int32")):
        with T.Kernel(1, threads=128):
            with T.Scale("device"):
                T.signal(flags[0], 1, op="mul")

    return main


def unknown_signal_scope():
    @T.prim_func
    def main(flags: T.Tensor((128,), "int32")):
        with T.Kernel(1, threads=128):
            with T.Scale("device"):
                T.signal(flags[0], 1, op="add", scope="thread")

    return main


def unknown_wait_scope():
    @T.prim_func
    def main(flags: T.Tensor((128,), "int32")):
        with T.Kernel(1, threads=128):
            with T.Scale("device"):
                T.wait(flags[0], "ge", 1, scope="grid")

    return main


def remote_into_tensor_from_address():
    @T.prim_func
    def main(A: T.Tensor((128,), "float32"), addr: T.int64):
        with T.Kernel(1, threads=128):
            with T.Scale("device") as (rank, world):
                C = T.make_tensor_from_addr(addr, (128,), "float32")
                T.copy(A, C, dst_pe=(rank + 1) % world)

    return main


@pytest.mark.parametrize(
    ("build", "error", "pattern"),
    [
        (remote_peer_out_of_range, IndexError, r"destination 'B': peer 5 out of range for world size 4"),
        (remote_source_out_of_range, IndexError, r"source 'A': peer -1 out of range for world size 4"),
        (remote_into_shared, TypeError, r"'tile' is a shared(\.dyn)? buffer"),
        (remote_into_fragment, TypeError, r"'tile' is a local\.fragment buffer"),
        (remote_both_sides, ValueError, r"dst_pe or src_pe, not both"),
        (barrier_outside_scale, RuntimeError, r"T\.barrier\(\) must be inside a T\.Scale"),
        (unknown_scale, ValueError, r"unknown scale 'galaxy'"),
        (float_flag, TypeError, r"flag tensor 'flags' must be int32, not float32"),
        (unknown_comparison, ValueError, r"comparison must be one of .* got 'approx'"),
        (unknown_signal_op, ValueError, r"op must be one of .* got 'mul'"),
        (unknown_signal_scope, ValueError, r"scope must be one of \('block', 'warp'\), got 'thread'"),
        (unknown_wait_scope, ValueError, r"T\.wait scope must be one of \('block', 'warp'\), got 'grid'"),
        (remote_into_tensor_from_address, TypeError, r"remote access to 'C': only tensor arguments"),
    ],
    ids=lambda v: v.__name__ if callable(v) and not isinstance(v, type) else None,
)
def test_build_errors(build, error, pattern):
    with build_options(world_size=4), pytest.raises(error, match=pattern):
        build()
    # The failed build left no context behind: the next kernel builds.
    with build_options(world_size=4):
        func = handshake(0)
    assert list(hidden_of(func)) == ["flags__peers", *SCALARS]


def test_distributed_kernel_needs_a_world_size(monkeypatch):
    monkeypatch.setattr(runtime, "_runtime", None)
    with pytest.raises(RuntimeError, match="build_options"):
        handshake(0)
    with pytest.raises(RuntimeError, match="build_options"):
        all_gather_kernel.__wrapped__(2, "bfloat16", 8, 132)


@pytest.mark.parametrize("size", [0, -2])
def test_build_options_needs_a_positive_world_size(size):
    with pytest.raises(ValueError, match="positive"), build_options(world_size=size):
        pass


def test_distributed_operations_outside_a_prim_func():
    with pytest.raises(RuntimeError, match="inside a tilescale T.prim_func"):
        T.barrier()
    with pytest.raises(RuntimeError, match="inside a tilescale T.prim_func"), T.Scale("device"):
        pass


def test_build_options_override_nests_and_restores():
    with build_options(world_size=2):
        with build_options(world_size=8):
            assert int(handshake(0).attrs["tilescale.world_size"]) == 8
        assert int(handshake(0).attrs["tilescale.world_size"]) == 2


# --- 5. the jit's checks before a launch --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_remote_output_allocated_by_the_kernel_is_refused():
    with build_options(world_size=2):
        func = push(256)
    with pytest.raises(TypeError, match="'B'"):
        DistributedKernel(func, out_idx=[-1], target=TARGET)


JIT_SCRIPT = r"""
import sys

import torch
import tilescale as ts
from tilescale import runtime
from tilescale.language import build_options

sys.path.insert(0, sys.argv[1])  # tests/ranks
import shared_kernels


push = ts.jit(target={"kind": "cuda", "arch": "sm_90a"})(shared_kernels.push)


def attempt(label, call):
    try:
        call()
        print(f"{label}: NO ERROR")
    except Exception as err:
        print(f"{label}: {type(err).__name__}: {err}")


ts.init(device="cpu")
print(f"WORLD {ts.world_size()} {ts.device()}")
kernel = push(256)
print(f"CACHED {push(256) is kernel}")
print(f"SOURCE_PUTS_THROUGH_TABLE {'B__peers[' in kernel.get_kernel_source()}")
print(f"PARAMS {kernel.params} INPUTS {kernel.inputs} HIDDEN {list(kernel.hidden)} WORLD_BUILT {kernel.world_size}")
A = torch.ones(256)
attempt("plain B", lambda: kernel(A, torch.zeros(256)))
attempt("symmetric A, plain B", lambda: kernel(ts.zeros((256,), dtype=torch.float32), torch.zeros(256)))
attempt("one argument", lambda: kernel(A))
attempt("three arguments", lambda: kernel(A, A, A))
print(f"LAUNCHED {runtime.current().last_kernel_args != ([], ())}")
with build_options(world_size=4):
    func = push.__wrapped__(256)
wrong_world = ts.jit(target={"kind": "cuda", "arch": "sm_90a"})(func)
B = ts.zeros((256,), dtype=torch.float32)
attempt("built for 4", lambda: wrong_world(A, B))
print(f"LAUNCHED {runtime.current().last_kernel_args != ([], ())}")
ts.finalize()
print("DONE")
"""


@needs_nvcc
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_jit_refuses_bad_arguments_before_launching(tmp_path):
    script = tmp_path / "jit_checks.py"
    script.write_text(textwrap.dedent(JIT_SCRIPT))
    # A fresh TileLang cache: the kernels really go through nvcc. No launcher: a world of one.
    proc = run_python(script, RANKS, env={"TILELANG_CACHE_DIR": str(tmp_path / "tilelang-cache")}, timeout=240,
                      cwd=tmp_path)
    explain = f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0 and "DONE" in proc.stdout, explain
    out = proc.stdout
    assert "WORLD 1 cpu" in out and "CACHED True" in out and "SOURCE_PUTS_THROUGH_TABLE True" in out, explain
    assert "PARAMS ['A', 'B'] INPUTS ['A', 'B'] HIDDEN ['B__peers', 'ts_rank'] WORLD_BUILT 1" in out, explain
    symmetric = "TypeError: argument 'B' is accessed on other ranks by this kernel, so it must be a symmetric tensor"
    assert f"plain B: {symmetric}" in out, explain
    assert f"symmetric A, plain B: {symmetric}" in out, explain
    assert "one argument: TypeError: kernel takes 2 arguments (A, B), got 1" in out, explain
    assert "three arguments: TypeError: kernel takes 2 arguments (A, B), got 3" in out, explain
    assert "built for 4: RuntimeError: kernel built for 4 ranks called in a job of 1" in out, explain
    assert "LAUNCHED True" not in out, explain  # every call was refused before the launch
    assert out.count("LAUNCHED False") == 2, explain


def test_the_device_headers_write_the_protocols_numbers():
    """The CUDA of the protocol (device.cuh, the NVSHMEM helpers) writes tilescale.protocol's
    numbers as literals: each one is checked here against its one definition in Python."""
    from tilescale.comm.nvshmem.lowering import NVSHMEM_PRELUDE
    from tilescale.protocol import (
        ARRIVALS_WORD,
        COMPARISON_TEXT,
        COMPARISONS,
        DEVICE_HEADER,
        EPOCH_WORD,
        SYNC_WORKSPACE_WORDS,
        WAIT_STATUS_FIELDS,
    )

    device = DEVICE_HEADER.read_text()
    for name, code in COMPARISONS.items():
        case = "default" if code == max(COMPARISONS.values()) else f"case {code}"
        assert f"{case}: return observed {COMPARISON_TEXT[code]} expected;" in device, name
        assert f"{case}: return NVSHMEM_CMP_{name.upper()};" in NVSHMEM_PRELUDE, name
    written = dict(re.findall(r"status\[(\d)\] = (\w+)", device))
    record = {"state": "1", "rank": "rank", "block": "block_id", "address": "addr", "comparison": "cmp",
              "expected": "expected", "observed": "observed", "kind": "kind"}
    assert {WAIT_STATUS_FIELDS[int(i)]: v for i, v in written.items()} == record
    for source in (device, NVSHMEM_PRELUDE):
        assert f"ws + {EPOCH_WORD}" in source and f"+ {ARRIVALS_WORD}" in source
    assert f"slots = {SYNC_WORKSPACE_WORDS} + (poll<false>(ws + {EPOCH_WORD}) & 1) * world" in device
