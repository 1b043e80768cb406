"""All-reduce with tilescale.ops.all_reduce (one-shot when small, two-shot when large) vs NCCL.

One-shot: every rank reads every peer's buffer and sums it (fewest steps: for latency).
Two-shot: rank r sums chunk r from everyone and pushes the result to everyone (each byte
crosses the links once each way: for bandwidth). Both accumulate in fp32 and, like
``dist.all_reduce``, work in place; on a symmetric tensor they need no extra copy.

    tilescale run -n 2 examples/all_reduce.py
    tilescale run -n 4 --cpu examples/all_reduce.py        # the CPU path, with small sizes
"""

import torch
import torch.distributed as dist

import tilescale as ts
from tilescale.testing import assert_close, do_bench


def main() -> None:
    ts.init()
    baseline = "NCCL" if ts.device().type == "cuda" else "gloo"
    sizes = (4096, 65536, 1000003, 16 * 2**20) if ts.device().type == "cuda" else (4096, 65536, 100003)
    for numel in sizes:
        x = ts.empty((numel,), dtype=torch.bfloat16)  # symmetric: reduced where it is
        x.copy_(torch.randn(numel, device=ts.device(), dtype=torch.bfloat16))
        ref = x.float()
        dist.all_reduce(ref)
        ts.ops.all_reduce(x)
        assert_close(x.float(), ref, rtol=1e-2, atol=1e-2)
        plain = torch.randn(numel, device=ts.device(), dtype=torch.bfloat16)  # not symmetric: staged
        ref = plain.float()
        dist.all_reduce(ref)
        assert_close(ts.ops.all_reduce(plain).float(), ref, rtol=1e-2, atol=1e-2)
        nccl_buf = x.clone()
        t_ts = do_bench(lambda x=x: ts.ops.all_reduce(x), iters=50)
        t_nccl = do_bench(lambda b=nccl_buf: dist.all_reduce(b), iters=50)
        if ts.rank() == 0:
            print(f"all_reduce {x.nbytes / 1024:9.0f} KiB correct: tilescale {t_ts * 1e3:8.1f} us, "
                  f"{baseline} {t_nccl * 1e3:8.1f} us ({t_nccl / t_ts:.2f}x)")
    ts.finalize()


if __name__ == "__main__":
    main()
