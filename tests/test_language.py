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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import tilelang.language as TL
from cuda_build import SCALARS, hidden_of, lower_cuda, needs_nvcc, nvcc
from shared_kernels import gemm, handshake
from tvm import tirx

import tilescale.language as T
from tilescale import runtime
from tilescale.jit import _user_params
from tilescale.language import build_options
from tilescale.language.sync import PRELUDE
from tilescale.ops._gemm import DEFAULT
from tilescale.ops.collectives import all_gather_kernel, reduce_kernel
from tilescale.ops.p2p import DEFAULT_PLAN, CopyPlan, transfer_kernel
from tilescale.ops.tp_gemm import kernels as tp_kernels

ROOT = Path(__file__).resolve().parent.parent
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


def left(r: int, p: int, w: int) -> int:  # the left neighbour first, self last (all_gather_gemm's pushers)
    return (r + w - 1 - p) % w


def push_left():
    """A put to every rank, the left neighbour first: ``(rank + world - 1 - p) % world``, which
    TileLang 0.1.15 compiled into an index without the rank where it was not wrapped."""

    @T.prim_func
    def main(src: T.Tensor((1024,), "float32"), dst: T.Tensor((1024,), "float32")):
        with T.Kernel(1, threads=128):
            with T.Scale("device") as (rank, world):
                for p in T.serial(world):
                    T.copy(src, dst, dst_pe=(rank + world - 1 - p) % world)
                T.barrier()

    return main


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
    "push_left": Spec(
        lambda w: push_left(), {"dst__peers": "dst"}, True, SCALARS, 1, 0, 0, (("dst__peers", left),),
        writes=True, reads=False,
    ),
    "put_fence_signal_wait_barrier": Spec(
        lambda w: put_fence_signal_wait_barrier(), {"dst__peers": "dst", "flags__peers": "flags"}, True, SCALARS,
        1, 2, 1, (("dst__peers", lambda r, p, w: (r + 1) % w), ("flags__peers", lambda r, p, w: (r + 1) % w)),
        writes=True, reads=False,
    ),
}
CASES = [(name, world) for name in KERNELS for world in (2, 3, 4, 8)]


@functools.cache
def built(name: str, world: int) -> tuple[tirx.PrimFunc, str]:
    """The kernel's PrimFunc for ``world`` ranks and its CUDA source (cached across tests)."""
    with build_options(world_size=world):
        func = KERNELS[name].build(world)
    return func, lower(func)


def param_names(func: tirx.PrimFunc) -> list[str]:
    return [func.buffer_map[p].name if p in func.buffer_map else p.name for p in func.params]


def kernel_body(src: str) -> str:
    """The definition of the generated __global__ function (after the prelude and its declaration)."""
    start = src.index("__global__ void __launch_bounds__")
    return src[start:]


def table_loads(src: str) -> list[tuple[str, str]]:
    """(peer table, index expression) of every ``X__peers[...]`` in the kernel body, in order:
    the index inside ``static_cast<int>(...)``, which every computed index goes through
    (a closed form TVM makes of it otherwise can drop the rank), without its int64 casts."""
    body = kernel_body(src)
    loads = []
    for m in re.finditer(r"\b(\w+__peers)\[", body):
        depth, i = 1, m.end()
        while depth:
            depth += {"[": 1, "]": -1}.get(body[i], 0)
            i += 1
        index = body[m.end():i - 1]
        if not re.fullmatch(r"\(*\d+\)*", index):  # a constant peer needs no wrapping
            assert index.startswith("static_cast<int>(") and index.endswith(")"), index
            index = index.removeprefix("static_cast<int>").replace("(int64_t)", "")
        loads.append((m.group(1), index))
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
    # A signal of this rank's own flag (no pe) takes the GPU-scope helper.
    assert body.count("tilescale::block_signal(") + body.count("tilescale::local_block_signal(") == spec.signals
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
            assert index.strip("()") == "peer"
            assert f"(static_cast<int>(peer) < {world})" in kernel_body(src)
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


@pytest.mark.parametrize("world", [3, 4, 8])
def test_all_gather_gemm_pushers_put_to_every_peer(world):
    # 4x H100: TileLang compiled the pushers' peer (rank + world - 1 - p) % world into an index
    # without the rank, so every rank put to the same peers and rank 1 got no rows at all.
    with build_options(world_size=world):
        src = lower(tp_kernels.ag_own_gemm_kernel.__wrapped__(world, "bfloat16", 256, 256, 256, 256, 4, DEFAULT))
    loads = table_loads(src)
    assert [t for t, _ in loads] == ["gathered__peers", "flags__peers"]
    for _, index in loads:
        for r in range(world):
            assert [evaluate(index, ts_rank=r, p=p) for p in range(world - 1)] == \
                [left(r, p, world) for p in range(world - 1)], (index, r)


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
    assert "= B__peers[static_cast<int>(((((int64_t)ts_rank) + (int64_t)1) & (int64_t)3))];" in body
    store = re.search(r"tl::tma_store\(\(&\(\(\(bfloat16_t\*\)v\)\[.*\]\)\), \(&\(tile\[0\]\)\), (\d+)\);", body)
    assert store and int(store.group(1)) == 32 * 256 * 2  # one block's rows, bytes
    assert body.index("tl::tma_store_wait") < body.index("tilescale::grid_barrier(")


def test_signal_and_wait_arguments():
    _, src = built("handshake", 4)
    body = kernel_body(src)
    assert "if (ts_rank != 1) {" in body
    assert "= flags__peers[static_cast<int>(((((int64_t)ts_rank) + (int64_t)1) & (int64_t)3))];" in body
    assert "tilescale::block_signal((&(((int*)v)[1])), 1, 0);" in body  # op "set"
    # The wait polls this rank's own flag (not through the table): "ge" is comparison 2.
    assert "tilescale::block_wait((&(flags[1])), 2, 1, ts_status, ts_rank, ts_timeout_ns);" in body

    _, src = built("put_fence_signal_wait_barrier", 2)
    body = kernel_body(src)
    assert "tilescale::block_signal((&(((int*)v_1)[ts_rank])), 1, 1);" in body  # op "add"
    assert "tilescale::block_wait((&(flags[2])), 3, 7, ts_status, ts_rank, ts_timeout_ns);" in body  # "gt"
    # pe=None: this rank's own flag, op "set", released at GPU scope (only this GPU's blocks wait on it).
    assert "tilescale::local_block_signal((&(flags[3])), 5, 0);" in body
    order = [body.index(s) for s in ("dst__peers[", "tilescale::block_fence();", "tilescale::block_signal((&(((",
                                     "tilescale::block_wait(", "tilescale::local_block_signal((&(flags[3]",
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
    # A signal of this rank's own flag releases at GPU scope: only this GPU's blocks wait on it.
    release = src[src.index("void release("):src.index("void block_release(")]
    local = release[release.index("} else {"):]
    assert "fence.acq_rel.gpu" in local and "red.release.gpu.global.add.s32" in local and ".sys" not in local
    assert "local_block_signal(int* addr, int value, int op) {\n  block_release<false>(" in src


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


def test_the_rank_passed_to_a_macro_keeps_its_parameter_name():
    """TileLang names a macro's parameter after the variable it is bound to, renaming the
    kernel's rank variable; the jit binds hidden parameters by name, so the built kernel must
    still call it ``ts_rank`` (before: a parameter ``r`` the jit could not bind)."""

    @T.macro
    def store_rank(out, r):
        out[r] = r

    def kernel():
        @T.prim_func
        def main(out: T.Tensor((4,), "int32")):
            with T.Kernel(1, threads=32):
                with T.Scale("device") as (rank, _):
                    store_rank(out, rank)

        return main

    with build_options(world_size=4):
        func = kernel()
    assert list(hidden_of(func)) == ["ts_rank"]
    assert param_names(func) == ["out", "ts_rank"]
    assert "out[ts_rank] = ts_rank;" in lower(func)


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
    # The PTX keeps the system-scope synchronisation the prelude writes in inline assembly (the
    # peer's signal adds; the kernel's one "set" is of its own flag: GPU scope).
    ptx = (tmp_path / "put_fence_signal_wait_barrier_2.ptx").read_text()
    assert ".entry main_kernel" in ptx and ".target sm_90a" in ptx
    for instruction in SYSTEM_SCOPE_PTX:
        if instruction != "st.release.sys.global.s32":
            assert instruction in ptx, instruction
    assert "st.release.gpu.global.s32" in ptx and "fence.acq_rel.gpu" in ptx
