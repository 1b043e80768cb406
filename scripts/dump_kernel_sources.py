"""Write the CUDA source TileLang generates for every library kernel, to compare two trees.

Example::

    python scripts/dump_kernel_sources.py /tmp/after               # this tree
    git worktree add /tmp/base f10b729 && (cd /tmp/base && PYTHONPATH=$PWD \
        python /path/to/scripts/dump_kernel_sources.py /tmp/before)
    diff -r /tmp/before /tmp/after

Each kernel is lowered for sm_90a without a GPU, twice: with the peer-address lowering
(``<name>.address.cu``) and with remote operations as NVSHMEM device calls
(``<name>.nvshmem.cu``), as ``tilescale.jit`` builds them for a group of 2 ranks. The
kernels are the collectives, the TP GEMMs, the MoE kernels, put/get and a barrier/agree
kernel; a kernel a tree does not have is skipped with a note.
"""

import importlib
import pkgutil
import sys
from pathlib import Path
from typing import Any

import tilelang
from tvm import tirx

import tilescale.language as T
from tilescale.language import build_options

TARGET = {"kind": "cuda", "arch": "sm_90a"}
NO_WS = {"tl.disable_warp_specialized": True}  # as the NVSHMEM loader builds GEMM kernels


def barrier_kernel():
    """T.barrier and T.agree, the device protocol's grid-wide operations."""

    @T.prim_func
    def main(sig: T.int32, out: T.Tensor((4,), "int32")):
        with T.Kernel(2, threads=128):
            with T.Scale("device"):
                ok = T.alloc_local((1,), "int32")
                ok[0] = T.agree(sig)
                T.barrier()
                out[0] = ok[0]

    return main


def find(name: str) -> Any:
    """The kernel factory ``name`` wherever ``tilescale.ops`` defines it (modules move between trees)."""
    import tilescale.ops as ops

    for info in [None, *pkgutil.walk_packages(ops.__path__, "tilescale.ops.")]:
        module = ops if info is None else importlib.import_module(info.name)
        if hasattr(module, name):
            return getattr(module, name)
    return None


def kernels() -> dict:
    """name -> (factory, args, pass configs) of every library kernel (factory None where this tree has none)."""
    from tilescale.ops._gemm import DEFAULT, NARROW, WIDE

    plan = find("DEFAULT_PLAN")  # p2p's copy plan
    return {
        "barrier_agree": (barrier_kernel, (), None),
        "all_gather": (find("all_gather_kernel"), (2, "bfloat16", 8, 132), None),
        "reduce_scatter": (find("reduce_kernel"), (2, "bfloat16", 8, 132, "scatter"), None),
        "all_reduce_two_shot": (find("reduce_kernel"), (2, "bfloat16", 8, 132, "push"), None),
        "put": (find("transfer_kernel"), ("bfloat16", 8, plan, 132, False), None),
        "get": (find("transfer_kernel"), ("bfloat16", 8, plan, 132, True), None),
        "moe_route": (find("route_kernel"), (2, 64, 4, 8), None),  # one block per bin (trees before 2026-11-26)
        # 200 tokens' class (32-token chunks, 128 at most); trees before 2026-11-28 took the count itself
        "moe_route_count": (find("route_count_kernel"), (2, 32, 128, 4, 8), None),
        "moe_route_finish": (find("route_finish_kernel"), (2, 32, 4, 8), None),
        "moe_dispatch": (find("dispatch_kernel"), (2, 64, 256, 4, 8, 1536, "bfloat16", 132, False), None),
        "moe_dispatch_low_latency": (find("dispatch_kernel"), (2, 64, 256, 4, 8, 1536, "bfloat16", 132, True), None),
        "moe_combine": (find("combine_kernel"), (2, 64, 256, 4, 1024, "bfloat16", 132), None),
        "ag_gemm": (find("ag_own_gemm_kernel"), (2, "bfloat16", 256, 256, 512, 512, 16, DEFAULT), None),
        "ag_gemm_wide": (find("ag_own_gemm_kernel"), (2, "bfloat16", 256, 256, 512, 512, 16, WIDE), None),
        "ag_peer_gemm": (find("ag_peer_gemm_kernel"), (2, "bfloat16", 256, 256, 512, 512, 1, DEFAULT, "state"), None),
        "announce": (find("announce_kernel"), (2,), None),
        "sum_received": (find("sum_received_kernel"), (2, 2, "bfloat16", 4096, 4096, 132), None),
        "gemm_rs_in_gemm": (find("gemm_reduce_scatter_kernel"), (2, "bfloat16", 512, 512, 512, DEFAULT, 1), NO_WS),
        "gemm_rs": (find("gemm_push_kernel"), (2, "bfloat16", 512, 512, 512, 2, DEFAULT, 1), NO_WS),
        "gemm_all_reduce": (find("all_reduce_gemm_kernel"), (2, "bfloat16", 128, 512, 1024, NARROW), NO_WS),
    }


def lower(func: tirx.PrimFunc, configs: dict | None) -> str:
    with tilelang.tvm.target.Target(TARGET), tilelang.tvm.transform.PassContext(opt_level=3, config=configs or {}):
        return tilelang.lower(func, target=TARGET).kernel_source


def main(out: Path, only: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, (factory, args, configs) in kernels().items():
        if only and name not in only:
            continue
        if factory is None:
            print(f"{name}: no such kernel in this tree", flush=True)
            continue
        raw = getattr(factory, "__wrapped__", factory)
        for remote in ("address", "nvshmem"):
            try:
                with build_options(world_size=2, remote=remote):
                    func = raw(*args)
                source = lower(func, configs)
            except Exception as err:  # noqa: BLE001 - recorded in the dump, which the diff shows
                source = f"// not lowered: {type(err).__name__}: {err}\n"
            (out / f"{name}.{remote}.cu").write_text(source)
            print(f"{name}.{remote}.cu: {len(source)} characters", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
