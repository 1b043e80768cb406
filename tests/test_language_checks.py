"""The tilescale language without a GPU, what is refused: API errors at build time, the jit's
checks before a launch, and the device headers' protocol numbers (see test_language.py for
what distributed kernels lower to).

No ``from __future__ import annotations`` here: TileLang evaluates the kernels' annotations.
"""

import re
import textwrap
from pathlib import Path

import pytest
from cpu_jobs import RANKS, run_python
from cuda_build import SCALARS, TARGET, hidden_of, needs_nvcc
from shared_kernels import handshake, push

import tilescale.language as T
from tilescale import runtime
from tilescale.jit import DistributedKernel
from tilescale.language import build_options
from tilescale.ops.collectives import all_gather_kernel

ROOT = Path(__file__).resolve().parent.parent


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
print(f"LAUNCHED {runtime.current().last_kernel_spans != ()}")
with build_options(world_size=4):
    func = push.__wrapped__(256)
wrong_world = ts.jit(target={"kind": "cuda", "arch": "sm_90a"})(func)
B = ts.zeros((256,), dtype=torch.float32)
attempt("built for 4", lambda: wrong_world(A, B))
print(f"LAUNCHED {runtime.current().last_kernel_spans != ()}")
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
