"""Rank program: symmetric allocation, neighbour writes, symmetric views, finalize (any world size >= 2).

Every check is an assert; the last line a rank prints is ``SYMMETRIC-OK rank=<r> world=<n>``.
"""

from __future__ import annotations

import gc
import os
import sys
import threading

import torch

import tilescale as ts

R, C = 4, 6
DTYPES = (torch.float32, torch.bfloat16, torch.int32)
REINIT_WATCHDOG_S = 8


def tagged(rank: int, dtype: torch.dtype, shape=(R, C)) -> torch.Tensor:
    """Values that name ``rank`` and are exact in every dtype of DTYPES (bfloat16 included)."""
    n = shape[0] * shape[1]
    return (torch.arange(n) % 16 + 32 * (rank + 1)).reshape(shape).to(dtype)


def main() -> None:
    rt = ts.init()
    assert ts.is_initialized()
    assert ts.init() is rt, "a second init() must return the same runtime"
    rank, world = ts.rank(), ts.world_size()
    assert world >= 2, world
    assert ts.device().type == "cpu" and ts.backend_name() == "host_shm", (ts.device(), ts.backend_name())
    print(f"JOB {rt.group.job_id}", flush=True)
    right, left = (rank + 1) % world, (rank - 1) % world

    # Every dtype: zeroed, writable through the right neighbour's view, receives the left one's values.
    tensors = {}
    for dtype in DTYPES:
        x = ts.zeros((R, C), dtype=dtype)
        assert x.shape == (R, C) and x.dtype == dtype and x.device.type == "cpu"
        assert ts.is_symmetric(x)
        assert torch.count_nonzero(x) == 0, f"ts.zeros is not zero on rank {rank}"
        tensors[dtype] = x
    ts.barrier()  # nobody writes before every rank has seen its zeros
    for dtype, x in tensors.items():
        peer = ts.peer_view(x, right)
        assert peer.shape == x.shape and peer.dtype == dtype and peer.stride() == x.stride()
        assert peer.data_ptr() != x.data_ptr()
        peer.copy_(tagged(rank, dtype))
        assert ts.peer_view(x, rank) is x
    ts.barrier()
    for dtype, x in tensors.items():
        assert torch.equal(x, tagged(left, dtype)), f"rank {rank} {dtype}: got {x} expected left {left}'s values"
        # Reading through a view sees what the owner sees.
        assert torch.equal(ts.peer_view(x, right), tagged(rank, dtype))
    ts.barrier()

    # Address table: one entry per rank, own entry is the local copy, peers differ.
    x = tensors[torch.float32]
    ptrs = ts.peer_ptrs(x)
    assert ptrs.dtype == torch.int64 and ptrs.shape == (world,) and ptrs.device == x.device
    assert ptrs[rank].item() == x.data_ptr()
    assert len(set(ptrs.tolist())) == world
    for r in range(world):
        assert ptrs[r].item() == ts.peer_view(x, r).data_ptr()
    assert ts.peer_ptrs(x) is ptrs, "tables are cached per view offset"

    # Views of a symmetric tensor stay symmetric: a row slice (contiguous) and a column slice (strided).
    y = ts.zeros((R, C), dtype=torch.float32)
    rows, cols = y[2:], y[:, 1::2]
    assert not cols.is_contiguous()
    for view in (rows, cols, y[1], y.view(-1)[3:7], y.t()):
        assert ts.is_symmetric(view)
        offset = view.data_ptr() - y.data_ptr()
        view_ptrs, base_ptrs = ts.peer_ptrs(view), ts.peer_ptrs(y)
        assert view_ptrs[rank].item() == base_ptrs[rank].item() + offset
        assert (view_ptrs - base_ptrs).tolist() == [offset] * world
        for r in range(world):
            pv = ts.peer_view(view, r)
            assert pv.shape == view.shape and pv.stride() == view.stride()
            assert pv.data_ptr() == view_ptrs[r].item()
    assert ts.peer_ptrs(rows)[rank].item() - ts.peer_ptrs(y)[rank].item() == 2 * C * 4
    assert ts.peer_ptrs(cols)[rank].item() - ts.peer_ptrs(y)[rank].item() == 4

    ts.barrier()
    ts.peer_view(rows, right).fill_(100 + rank)  # rows 2.. of the right neighbour
    ts.peer_view(cols, right)[:2] += 1000 * (rank + 1)  # odd columns of its rows 0 and 1
    ts.barrier()
    expect = torch.zeros(R, C)
    expect[2:] = 100 + left
    expect[:2, 1::2] = 1000 * (left + 1)
    assert torch.equal(y, expect), f"rank {rank}: views wrote\n{y}\nexpected\n{expect}"
    ts.barrier()

    # Errors: non-symmetric tensors, peers out of range.
    plain = torch.zeros(R, C)
    assert not ts.is_symmetric(plain) and not ts.is_symmetric(y.clone()) and not ts.is_symmetric("y")
    for bad in (plain, y.clone(), y[1:].contiguous().clone()):
        try:
            ts.peer_view(bad, right)
        except TypeError as err:
            assert "symmetric" in str(err), err
        else:
            raise AssertionError("peer_view of a plain tensor did not raise TypeError")
        try:
            ts.peer_ptrs(bad)
        except TypeError:
            pass
        else:
            raise AssertionError("peer_ptrs of a plain tensor did not raise TypeError")
    for r in (world, world + 3, -1):
        try:
            ts.peer_view(y, r)
        except IndexError as err:
            assert str(r) in str(err) and str(world) in str(err), err
        else:
            raise AssertionError(f"peer_view(y, {r}) did not raise IndexError")

    # A view keeps the allocation alive (and symmetric) after its base is gone.
    keep = y[1:]
    del y, rows, cols
    gc.collect()
    assert ts.is_symmetric(keep)
    ts.barrier()
    ts.peer_view(keep, right)[0, 0] = 7.0
    ts.barrier()
    assert keep[0, 0].item() == 7.0

    # Init after init with other settings is refused.
    for kwargs in ({"backend": "cuda_ipc"}, {"device": "cuda"}):
        try:
            ts.init(**kwargs)
        except RuntimeError as err:
            assert "already initialised" in str(err), err
        else:
            raise AssertionError(f"init({kwargs}) after a CPU init did not raise")
    assert ts.init(backend="host_shm", device="cpu") is rt

    ts.finalize()
    assert not ts.is_initialized()
    ts.finalize()  # a second finalize does nothing
    try:
        ts.zeros((2,))
    except RuntimeError as err:
        assert "init" in str(err), err
    else:
        raise AssertionError("allocation after finalize did not raise")
    # The memory itself stays valid as long as the tensors live.
    assert torch.equal(tensors[torch.int32], tagged(left, torch.int32))
    print(f"SYMMETRIC-OK rank={rank} world={world}", flush=True)
    reinit(rt)


def reinit(old: object) -> None:
    """init() again after finalize(), while the old runtime is still referenced (as ``rt = ts.init()`` keeps it).

    Prints ``REINIT-OK rank=<r>`` or ``REINIT-FAILED rank=<r> <error>``; never raises, so a
    failure here does not hide the checks above. A watchdog ends the rank (status 0) if this
    part hangs: a broken rendezvous can sit in gloo's connect for a minute.
    """
    who = os.environ.get("RANK", os.environ.get("PMI_RANK"))

    def give_up() -> None:
        print(f"REINIT-FAILED rank={who} hung for {REINIT_WATCHDOG_S} s", flush=True)
        os._exit(0)

    watchdog = threading.Timer(REINIT_WATCHDOG_S, give_up)
    watchdog.daemon = True
    watchdog.start()
    os.environ["TILESCALE_COLLECTIVE_TIMEOUT_S"] = "5"
    try:
        rt = ts.init(timeout_s=REINIT_WATCHDOG_S)
        assert rt is not old
        print(f"JOB {rt.group.job_id}", flush=True)
        rank, world = ts.rank(), ts.world_size()
        x = ts.zeros((8,), dtype=torch.int32)
        ts.barrier()
        ts.peer_view(x, (rank + 1) % world).fill_(rank + 1)
        ts.barrier()
        assert x.tolist() == [(rank - 1) % world + 1] * 8, x
        ts.finalize()
        print(f"REINIT-OK rank={rank}", flush=True)
    except Exception as err:
        msg = f"{type(err).__name__}: {err}".replace("\n", " ")
        print(f"REINIT-FAILED rank={who} {msg}", flush=True)
    watchdog.cancel()


if __name__ == "__main__":
    main()
    sys.exit(0)
