"""The fused TP GEMMs' exchanges: symmetric receive buffers and flags per group and shape,
double-buffered, with the call count on the device (:class:`_Exchange`) or, for the
copy-engine all-gather, on the host (:class:`_GatherExchange`), and the stream-ordered flag
writes that producer uses (:class:`_StreamWrites`)."""

from dataclasses import dataclass

import torch

from tilescale import runtime
from tilescale.groups import GroupState
from tilescale.symmetric import peer_view


@dataclass
class _Exchange:
    """Two sets of symmetric receive buffers (stacked along the rows), the flags, and on the
    device ``state``: the calls so far, the arrivals each flag has counted in them, and the
    blocks of the running call's first kernel counted in so far (0 between calls).

    A call's first kernel counts the call (``T.count_call``): its blocks read the call's
    number (call i uses buffer set i % 2) and flag target (the total so far plus what this
    call adds to each flag), and its last block advances ``state``; the call's second kernel,
    if any, reads the advanced ``state``. Nothing is done on the host per call, so a CUDA
    graph replays the count, and every launch advances it once, also when a wait in it timed
    out (the kernel still runs to its end).

    Calls alternate between the two buffers, which is what lets a rank write into a peer
    without first meeting it in a barrier: when rank r starts call i + 2 (writing buffer
    i % 2 again), r's call i + 1 has finished, so it has seen the peer's call i + 1 writes,
    so the peer started call i + 1 after finishing call i (one stream), the last reader of
    buffer i % 2.
    """

    buffers: torch.Tensor
    flags: torch.Tensor
    state: torch.Tensor  # (3,) int32 on this rank's device: [calls, flag target, blocks counted in]


def _exchange(state: GroupState, key: tuple, shape: tuple[int, ...], dtype: torch.dtype, flags: int) -> _Exchange:
    """The group's exchange of ``key`` (its buffers allocated, collectively, at first use)."""

    def create() -> _Exchange:
        runtime.check_not_capturing(f"TP GEMM exchange {key}")
        return _Exchange(state.allocate((2 * shape[0], *shape[1:]), dtype), state.allocate((flags,), torch.int32),
                         torch.zeros(3, dtype=torch.int32, device=runtime.device()))

    return state.exchange(("tp_gemm", *key), create)


def _local_buffer(state: GroupState, key: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The group's rank-local scratch tensor of ``key`` (``key[-1]``: its shape), kept for the
    group's life beside its exchanges, so the kernels that share a key share it."""

    def create() -> torch.Tensor:
        runtime.check_not_capturing(f"TP GEMM scratch {key}")
        return torch.empty(key[-1], dtype=dtype, device=runtime.device())

    return state.exchange(("tp_gemm", *key, dtype), create)


class _StreamWrites:
    """``cuStreamWriteValue32``: a 32-bit store that a stream performs once its earlier work is
    complete (with a system-scope fence first), done by the GPU's front end, not by an SM, so
    it lands even while a GEMM holds every SM waiting for it."""

    def __init__(self) -> None:
        import ctypes

        self._ctypes = ctypes
        lib = ctypes.CDLL("libcuda.so.1")
        self._write = getattr(lib, "cuStreamWriteValue32_v2", None) or lib.cuStreamWriteValue32
        self._write.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._write.restype = ctypes.c_int

    def __call__(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        err = self._write(self._ctypes.c_void_p(stream.cuda_stream), address, value, 0)
        if err:
            raise RuntimeError(f"cuStreamWriteValue32 failed with CUresult {err}")


_stream_writes: _StreamWrites | None = None


@dataclass
class _GatherExchange:
    """The copy-engine all-gather's buffers: two sets of gathered rows (stacked along the rows),
    one flag per (segment, chunk), and the calls so far, counted on the host.

    A call's flags are set to its call count (``epoch``): flags only grow, so none is reset.
    Calls alternate between the two sets, as :class:`_Exchange`'s do and for the same reason.
    The host counts the calls, so a CUDA graph could only replay one epoch: captured calls
    take the SM pushers' plan instead (:func:`all_gather_gemm`).
    """

    buffers: torch.Tensor
    flags: torch.Tensor
    peer_buffers: list[torch.Tensor]
    peer_flags: list[torch.Tensor]
    stream: torch.cuda.Stream | None
    calls: int = 0


def _gather_exchange(state: GroupState, key: tuple, rows: int, k: int, dtype: torch.dtype,
                     flags: int) -> _GatherExchange:
    """The group's copy-engine exchange of ``key`` (allocated, collectively, at first use)."""

    def create() -> _GatherExchange:
        runtime.check_not_capturing(f"TP GEMM exchange {key}")
        buffers, flag = state.allocate((2 * rows, k), dtype), state.allocate((flags,), torch.int32)
        stream = None
        if buffers.is_cuda:  # high priority: its copies and flag writes go first where kernels wait for them
            stream = torch.cuda.Stream(buffers.device, priority=-1)
        return _GatherExchange(buffers, flag, [peer_view(buffers, p) for p in range(state.size)],
                               [peer_view(flag, p) for p in range(state.size)], stream)

    return state.exchange(("tp_gemm", *key), create)

