"""Symmetric tensors: every rank owns a copy, and any rank can write into any other's.

Each rank fills a block of rows in its right neighbour's copy through ``ts.peer_view``
(a plain torch view of the peer's memory: NVLink on GPUs, shared memory on the CPU path),
then checks what its left neighbour wrote into its own copy, and times the exchange
against ``torch.distributed`` send/recv of the same bytes.

    tilescale run -n 2 examples/symmetric_tensors.py          # GPUs, or the CPU path without them
    tilescale run -n 4 --cpu examples/symmetric_tensors.py
"""

import time

import torch
import torch.distributed as dist

import tilescale as ts


def main(rows: int = 256, cols: int = 1024) -> None:
    ts.init()
    rank, world = ts.rank(), ts.world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    dev = ts.device()

    x = ts.zeros((world * rows, cols), dtype=torch.float32)
    mine = torch.randn(rows, cols, device=dev, generator=torch.Generator(device=dev).manual_seed(rank))
    ts.barrier()
    ts.peer_view(x, right)[rank * rows:(rank + 1) * rows].copy_(mine)  # write into the neighbour
    ts.barrier()

    expected = torch.randn(rows, cols, device=dev, generator=torch.Generator(device=dev).manual_seed(left))
    got = x[left * rows:(left + 1) * rows]
    assert torch.equal(got, expected), f"rank {rank}: rows from rank {left} are wrong"
    untouched = torch.cat([x[: left * rows], x[(left + 1) * rows:]])
    assert torch.count_nonzero(untouched) == 0, f"rank {rank}: a write landed outside its rows"

    # A small benchmark: peer_view copy vs torch.distributed send/recv of the same block.
    def timed(fn, iters: int = 20) -> float:
        ts.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        ts.synchronize()
        return (time.perf_counter() - start) / iters * 1e3

    peer = ts.peer_view(x, right)[rank * rows:(rank + 1) * rows]
    t_peer = timed(lambda: peer.copy_(mine))
    # gloo (the CPU path, or ranks sharing a GPU) sends host tensors only.
    sent = mine.cpu() if dist.get_backend() == "gloo" else mine
    buf = torch.empty_like(sent)

    def sendrecv() -> None:
        ops = [dist.P2POp(dist.isend, sent, right), dist.P2POp(dist.irecv, buf, left)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    t_dist = timed(sendrecv)
    print(f"rank {rank}/{world} on {dev}: neighbour exchange correct; "
          f"{mine.numel() * 4 / 2**20:.1f} MiB: peer_view copy {t_peer:.3f} ms, "
          f"torch.distributed send/recv {t_dist:.3f} ms")
    ts.finalize()


if __name__ == "__main__":
    main()
