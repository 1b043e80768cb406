"""The device-side check of a grouped row layout that a caller built for ``ts.ops.grouped_gemm``.

A grouped GEMM block takes its weights from the expert of its tile's first row and reads
its A rows through ``index`` where one is given. A caller's own layout can break that
contract where ``moe_dispatch``'s never does: an expert id past the weights' last expert (its
TMA weight load falls out of bounds and reads zeros), a tile mixing experts (rows computed
with another expert's weights), an index past ``x``'s rows. Each gives wrong rows and no
error, so layouts not made by ``moe_dispatch`` are checked on the device, without a host
synchronisation (CUDA graphs capture it): one block per tile records the first row showing
each fault in a record kept in device memory, copied after every check, in stream order, to
pinned host memory, which the host reads before each grouped GEMM, at ``ts.synchronize()``
and at ``ts.finalize()`` and raises :class:`tilescale.GroupedLayoutError` from.

Example::

    out = ts.ops.grouped_gemm(x, w, my_row_expert)   # expert 9 of 8 in row 300: no error yet
    ts.synchronize()                                 # GroupedLayoutError: ... first at row 300
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

import torch

import tilescale.language as T
from tilescale import runtime
from tilescale.errors import GroupedLayoutError
from tilescale.jit import jit

# The record: per kind of fault, the first row that shows it (NO_ROW: none yet).
FAULTS = ("expert id out of range", "row of another expert than its tile's first row", "index out of range")
NO_ROW = 2**30  # a fault's first row before any was seen (rows are fewer)
_CLEAR = [NO_ROW] * len(FAULTS)


@jit
def check_layout_kernel(rows: int, block_M: int, experts: int, sources: int):
    """Records the first row of a grouped GEMM's layout showing each breach of its contract (:data:`FAULTS`):
    an expert id outside -1 to ``experts - 1``, a row of an expert in a tile whose first row
    names another (or none), an index outside -1 to ``sources - 1`` (``sources`` 0: no index).

    Args:
        rows: Rows of the layout, a multiple of ``block_M``.
        block_M: Rows per GEMM tile (the threads of a block: one per row).
        experts: Experts whose weights the GEMM holds.
        sources: Rows of the GEMM's ``x`` an index may name; 0 where the GEMM has no index.

    Returns:
        The kernel's ``T.prim_func`` (``row_expert``, ``index``, ``record``); a call through
        ``ts.jit`` gives the compiled kernel, cached per arguments.
    """

    @T.prim_func
    def main(row_expert: T.Tensor((rows,), "int32"), index: T.Tensor((rows,), "int32"),
             record: T.Tensor((len(FAULTS),), "int32")):
        with T.Kernel(rows // block_M, threads=block_M) as by:
            first = by * block_M
            # Per fault, the row where it shows (NO_ROW where it does not).
            out_of_range = T.alloc_fragment((block_M,), "int32")
            mixed = T.alloc_fragment((block_M,), "int32")
            bad_index = T.alloc_fragment((block_M,), "int32")
            for i in T.Parallel(block_M):
                expert = row_expert[first + i]
                out_of_range[i] = T.if_then_else(T.Or(expert < -1, expert >= experts), first + i, NO_ROW)
                mixed[i] = T.if_then_else(T.And(T.And(expert >= 0, expert < experts), expert != row_expert[first]),
                                          first + i, NO_ROW)
                if sources > 0:
                    bad_index[i] = T.if_then_else(T.Or(index[first + i] < -1, index[first + i] >= sources), first + i,
                                                  NO_ROW)
                else:
                    bad_index[i] = NO_ROW
            _record_first(out_of_range, record, 0)
            _record_first(mixed, record, 1)
            _record_first(bad_index, record, 2)

    return main


@T.macro
def _record_first(rows_at, record, fault: int):
    """``record[fault]`` lowered to the least of ``rows_at`` (the block's rows showing the fault)."""
    least = T.alloc_fragment((1,), "int32")
    T.reduce_min(rows_at, least, dim=0)
    if least[0] < NO_ROW:  # in every thread: stores of one minimum
        T.atomic_min(record[fault], least[0])


class _Record:
    """One device's fault record: the words the check kernel counts in, and their pinned
    host copy that the host reads without synchronising."""

    def __init__(self, device: torch.device):
        self.device = device
        self.words = torch.tensor(_CLEAR, dtype=torch.int32, device=device)
        # On the host whatever torch's default device is (programs set it to their GPU).
        self.host = torch.tensor(_CLEAR, dtype=torch.int32, device="cpu", pin_memory=device.type == "cuda")
        self.host_view = self.host.numpy()  # read before every grouped GEMM: no torch dispatch
        self.calls = 0  # checks launched, for the message

    def raise_recorded(self) -> None:
        """Raise :class:`GroupedLayoutError` for the faults a check has recorded (and clear them)."""
        view = self.host_view
        if view.min() == NO_ROW:
            return
        if self.words.is_cuda and not torch.cuda.is_current_stream_capturing():
            # Checks still queued copy the record again: let them land first, so none of them
            # writes the fault back over the cleared copy (and the message has all of them).
            torch.cuda.synchronize(self.device)
        found = "; ".join(f"{fault} (first at row {row})" for fault, row in zip(FAULTS, view.tolist(), strict=True)
                          if row != NO_ROW)
        clear = torch.tensor(_CLEAR, dtype=torch.int32, device="cpu")
        self.words.copy_(clear)
        self.host.copy_(clear)
        calls, self.calls = self.calls, 0
        raise GroupedLayoutError(
            f"grouped_gemm on {self.device} was given a row layout that breaks its contract, in one of the last "
            f"{calls} call(s) with a layout not made by moe_dispatch ({found}); those rows came out wrong. Each "
            "tile of rows must belong to one expert, its first row's (-1: none; other rows that expert or -1), "
            "with expert ids below w's first dimension and index entries below x's rows.")


_records: dict[torch.device, _Record] = {}


def _record(device: torch.device) -> _Record:
    found = _records.get(device)
    if found is None:  # its words are copied in from the host: not inside a CUDA graph capture
        runtime.check_not_capturing(f"grouped_gemm with a row layout of the caller's own on {device} (the layout "
                                    "check's record)")
        found = _records[device] = _Record(device)
    return found


def raise_recorded() -> None:
    """Raise :class:`GroupedLayoutError` if a check of a caller-built layout found faults
    (a host-memory read per device that ran one; ``ts.synchronize()`` calls this)."""
    for record in _records.values():
        record.raise_recorded()


runtime.add_device_check(raise_recorded)


def check_layout(row_expert: torch.Tensor, index: torch.Tensor | None, block_M: int, experts: int,
                 sources: int) -> None:
    """Raise what an earlier check recorded, then queue the check of this layout (no synchronisation).

    Args:
        row_expert: (rows,) int32 expert of each output row.
        index: (rows,) int32 row of ``x`` each output row reads, or None.
        block_M: Rows per GEMM tile.
        experts: Experts whose weights the GEMM holds.
        sources: Rows of the GEMM's ``x``.
    """
    record = _record(row_expert.device)
    record.raise_recorded()
    kernel = check_layout_kernel(row_expert.shape[0], block_M, experts, 0 if index is None else sources)
    kernel(row_expert, row_expert if index is None else index, record.words)
    record.calls += 1
    if record.words.is_cuda:
        record.host.copy_(record.words, non_blocking=True)
    else:  # the CPU path has run the check already: raise before the GEMM reads out of bounds
        record.host.copy_(record.words)
        record.raise_recorded()
