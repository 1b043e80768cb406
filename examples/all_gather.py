"""All-gather with tilescale.ops.all_gather, checked against and timed beside NCCL.

Each rank pushes its shard into every peer's output with remote tile copies
(``T.copy(tile, out[rank, base], dst_pe=p)``), visiting peers from ``rank + 1`` on;
device-scope barriers open and close the exchange.

    tilescale run -n 2 examples/all_gather.py
    tilescale run -n 4 --cpu examples/all_gather.py        # the CPU path, 1 MiB per rank
"""

import torch
import torch.distributed as dist

import tilescale as ts
from tilescale.testing import assert_close, do_bench


def main() -> None:
    ts.init()
    baseline = "NCCL" if ts.device().type == "cuda" else "gloo"
    world = ts.world_size()
    rows, cols = (8192, 4096) if ts.device().type == "cuda" else (512, 1024)
    x = torch.randn(rows, cols, device=ts.device(), dtype=torch.bfloat16)
    out = ts.empty((world * rows, cols), dtype=torch.bfloat16)
    ts.ops.all_gather(x, out=out)
    ref = torch.empty_like(out)
    dist.all_gather_into_tensor(ref, x)
    assert_close(out, ref, rtol=0, atol=0)

    ragged = torch.randn(1000, 37, device=ts.device(), dtype=torch.float16)  # not a multiple of any tile
    ragged_ref = torch.empty(world * 1000, 37, device=ts.device(), dtype=torch.float16)
    dist.all_gather_into_tensor(ragged_ref, ragged)
    assert_close(ts.ops.all_gather(ragged), ragged_ref, rtol=0, atol=0)

    t_ts = do_bench(lambda: ts.ops.all_gather(x, out=out))
    t_nccl = do_bench(lambda: dist.all_gather_into_tensor(ref, x))
    received = x.nbytes * (world - 1)
    if ts.rank() == 0:
        print(f"all_gather of {x.nbytes / 2**20:.0f} MiB per rank correct: tilescale {t_ts:.3f} ms "
              f"({received / t_ts / 1e6:.0f} GB/s), {baseline} {t_nccl:.3f} ms ({received / t_nccl / 1e6:.0f} GB/s)")
    ts.finalize()


if __name__ == "__main__":
    main()
