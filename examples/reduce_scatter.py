"""Reduce-scatter with tilescale.ops.reduce_scatter vs NCCL's reduce_scatter_tensor.

Rank r reads rows block r of every peer's input with remote tile copies
(``T.copy(src[r, base], part, src_pe=p)``) and sums them in fp32.

    tilescale run -n 2 examples/reduce_scatter.py
    tilescale run -n 4 --cpu examples/reduce_scatter.py    # the CPU path, with small shapes
"""

import torch
import torch.distributed as dist

import tilescale as ts
from tilescale.testing import assert_close, do_bench


def main() -> None:
    ts.init()
    baseline = "NCCL" if ts.device().type == "cuda" else "gloo"
    world = ts.world_size()
    rows, cols = (8192, 4096) if ts.device().type == "cuda" else (512, 256)
    x = ts.empty((rows, cols), dtype=torch.bfloat16)  # symmetric: read in place by peers
    x.copy_(torch.randn(rows, cols, device=ts.device(), dtype=torch.bfloat16))
    got = ts.ops.reduce_scatter(x)
    ref = torch.empty(rows // world, cols, device=ts.device(), dtype=torch.float32)
    dist.reduce_scatter_tensor(ref, x.float())
    assert_close(got.float(), ref, rtol=1e-2, atol=1e-2)

    nccl_out = torch.empty(rows // world, cols, device=ts.device(), dtype=torch.bfloat16)
    t_ts = do_bench(lambda: ts.ops.reduce_scatter(x))
    t_nccl = do_bench(lambda: dist.reduce_scatter_tensor(nccl_out, x))
    if ts.rank() == 0:
        print(f"reduce_scatter of {x.nbytes / 2**20:.0f} MiB per rank correct: tilescale {t_ts:.3f} ms, "
              f"{baseline} {t_nccl:.3f} ms ({t_nccl / t_ts:.2f}x)")
    ts.finalize()


if __name__ == "__main__":
    main()
