"""Rank program: every rank puts a row into every rank's copy of one symmetric tensor, then each checks its copy.

With ranks sharing several GPUs (``--share-gpus``, e.g. four ranks over two GPUs) each rank
has peers on its own GPU and on the other: both kinds of store must land. Prints ``PUT-OK``.

    CUDA_VISIBLE_DEVICES=0,1 tilescale run -n 4 --share-gpus tests/ranks/put_every_peer.py
    tilescale run -n 3 --cpu tests/ranks/put_every_peer.py
"""

import torch

import tilescale as ts

ts.init()
rank, world = ts.rank(), ts.world_size()
rows = ts.symmetric.zeros((world, 4096), dtype=torch.float32)
mine = torch.full((4096,), float(rank + 1), device=ts.device())
for peer in range(world):
    ts.ops.put(mine, rows[rank], peer=peer)
ts.barrier()  # after every rank's puts have landed
wrong = [src for src in range(world) if not bool((rows[src] == src + 1).all())]
assert not wrong, f"rank {rank} on {ts.device()}: rows from ranks {wrong} did not arrive"
print(f"rank {rank} on {ts.device()}: PUT-OK", flush=True)
ts.finalize()
