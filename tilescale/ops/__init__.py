"""Library kernels written in the tilescale language, with torch tensors in and out."""

from tilescale.ops.collectives import all_gather, all_reduce, reduce_scatter
from tilescale.ops.p2p import get, put

__all__ = ["all_gather", "all_reduce", "get", "put", "reduce_scatter"]
