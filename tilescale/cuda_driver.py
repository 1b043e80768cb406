"""The CUDA driver calls that learning a kernel's launch needs (``tilescale.op_launch``), through ctypes.

Example::

    captured = capture_kernel(lambda: kernel_entry(*args), device)   # nothing runs
    captured.params, captured.blob                                     # its parameters' layout and bytes

Only a launch's first calls come here; the launches made from what they learned go through
the C++ launcher (``tilescale/csrc/launcher.cpp``).

No build step: the driver library (``libcuda.so.1``) comes with every NVIDIA driver, and its
entry points are looked up by ``cuGetProcAddress`` for the CUDA version whose structures this
module lays out (12.4: ``cuFuncGetParamInfo`` is the newest call used).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

_CUDA_VERSION = 12040
_CAPTURE_THREAD_LOCAL = 1  # CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
_NODE_KERNEL = 0  # CU_GRAPH_NODE_TYPE_KERNEL
# Launch attributes a captured kernel node may carry that change how it runs (CUlaunchAttributeID).
_COOPERATIVE, _CLUSTER_DIMENSION, _CLUSTER_SCHEDULING = 2, 4, 5


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


class _AttributeValue(ctypes.Union):
    _fields_ = [("bytes", ctypes.c_ubyte * 64), ("words", ctypes.c_uint * 3)]


class _KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS (v2, CUDA 12)
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("params", ctypes.POINTER(ctypes.c_void_p)),
                ("extra", ctypes.POINTER(ctypes.c_void_p)), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


_P, _SZ = ctypes.c_void_p, ctypes.c_size_t
_SIGNATURES: dict[str, tuple] = {
    "cuGetErrorString": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
    "cuStreamBeginCapture": (_P, ctypes.c_int),
    "cuStreamEndCapture": (_P, ctypes.POINTER(_P)),
    "cuGraphGetNodes": (_P, ctypes.POINTER(_P), ctypes.POINTER(_SZ)),
    "cuGraphNodeGetType": (_P, ctypes.POINTER(ctypes.c_int)),
    "cuGraphKernelNodeGetParams": (_P, ctypes.POINTER(_KernelNodeParams)),
    "cuGraphKernelNodeGetAttribute": (_P, ctypes.c_int, ctypes.POINTER(_AttributeValue)),
    "cuGraphDestroy": (_P,),
    "cuKernelGetFunction": (ctypes.POINTER(_P), _P),
    "cuFuncGetParamInfo": (_P, _SZ, ctypes.POINTER(_SZ), ctypes.POINTER(_SZ)),
    "cuTensorMapReplaceAddress": (_P, _P),
}


@functools.cache
def _library() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


@functools.cache
def function(name: str) -> Callable[..., int]:
    """The driver's ``name`` (for CUDA 12.4's structures), as a ctypes function returning its CUresult.

    Raises:
        CudaDriverError: the driver has no such entry point (a driver older than CUDA 12.4).
    """
    lib = _library()
    address, status = ctypes.c_void_p(), ctypes.c_int()
    lookup = lib.cuGetProcAddress_v2
    lookup.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                       ctypes.POINTER(ctypes.c_int)]
    rc = lookup(name.encode(), ctypes.byref(address), _CUDA_VERSION, 0, ctypes.byref(status))
    if rc != 0 or not address.value:
        raise CudaDriverError(f"the CUDA driver has no {name} for CUDA {_CUDA_VERSION} (cuGetProcAddress: {rc})")
    return ctypes.CFUNCTYPE(ctypes.c_int, *_SIGNATURES[name])(address.value)


def check(name: str, rc: int) -> None:
    """Raise :class:`CudaDriverError` for a failed driver call ``name`` that returned ``rc``."""
    if rc != 0:
        text = ctypes.c_char_p()
        function("cuGetErrorString")(rc, ctypes.byref(text))
        raise CudaDriverError(f"{name} failed: {(text.value or b'?').decode()} ({rc})")


def _call(name: str, *args: object) -> None:
    check(name, function(name)(*args))


def replace_address(tensor_map: int, address: int) -> int:
    """``cuTensorMapReplaceAddress`` on the 64-byte aligned ``CUtensorMap`` at ``tensor_map``; returns its CUresult."""
    return function("cuTensorMapReplaceAddress")(tensor_map, address)


@dataclass
class CapturedKernel:
    """One kernel launch as a stream capture recorded it: what ``cuLaunchKernelEx`` needs again."""

    func: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    params: list[tuple[int, int]]  # (offset, size) of each parameter
    blob: bytes  # the parameters' bytes, each at its offset
    attributes: list[tuple[int, bytes]]  # (CUlaunchAttributeID, value bytes) the node carries


_capture_streams: dict[int, torch.cuda.Stream] = {}


def capture_kernel(launch: Callable[[], object], device: torch.device) -> CapturedKernel | None:
    """The one kernel that ``launch()`` enqueues on the current stream, recorded by a stream
    capture on a side stream of ``device``: nothing runs. None if it enqueued anything but
    exactly one kernel, or a kernel whose parameters the driver does not describe.

    Raises:
        CudaDriverError: a driver call failed (``launch``'s own exceptions pass through).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _capture_streams.get(index)
    if stream is None:
        stream = _capture_streams[index] = torch.cuda.Stream(device=index)
    graph = ctypes.c_void_p()
    with torch.cuda.stream(stream):
        _call("cuStreamBeginCapture", stream.cuda_stream, _CAPTURE_THREAD_LOCAL)
        try:
            launch()
        finally:
            rc = function("cuStreamEndCapture")(stream.cuda_stream, ctypes.byref(graph))
        check("cuStreamEndCapture", rc)
    try:
        return _kernel_of(graph)
    finally:
        _call("cuGraphDestroy", graph)


def _kernel_of(graph: ctypes.c_void_p) -> CapturedKernel | None:
    count = ctypes.c_size_t(0)
    _call("cuGraphGetNodes", graph, None, ctypes.byref(count))
    if count.value != 1:
        return None
    node, kind = ctypes.c_void_p(), ctypes.c_int()
    _call("cuGraphGetNodes", graph, ctypes.byref(node), ctypes.byref(count))
    _call("cuGraphNodeGetType", node, ctypes.byref(kind))
    if kind.value != _NODE_KERNEL:
        return None
    p = _KernelNodeParams()
    _call("cuGraphKernelNodeGetParams", node, ctypes.byref(p))
    func = p.func
    if not func and p.kern:
        found = ctypes.c_void_p()
        _call("cuKernelGetFunction", ctypes.byref(found), p.kern)
        func = found.value
    if not func or not p.params:
        return None
    params = []
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    while function("cuFuncGetParamInfo")(func, len(params), ctypes.byref(offset), ctypes.byref(size)) == 0:
        params.append((offset.value, size.value))
    blob = bytearray(max((o + s for o, s in params), default=0))
    for i, (o, s) in enumerate(params):
        blob[o:o + s] = ctypes.string_at(p.params[i], s)
    attributes = []
    for attr in (_COOPERATIVE, _CLUSTER_DIMENSION, _CLUSTER_SCHEDULING):
        value = _AttributeValue()
        if function("cuGraphKernelNodeGetAttribute")(node, attr, ctypes.byref(value)) == 0 and any(value.bytes):
            attributes.append((attr, bytes(value.bytes)))
    return CapturedKernel(func=func, grid=tuple(p.grid), block=tuple(p.block), shared_bytes=p.shared_bytes,
                          params=params, blob=bytes(blob), attributes=attributes)
