"""Checks the agreement rank programs share (tests/ranks/*_agreement.py)."""

from collections.abc import Callable

import tilescale as ts


def expect_mismatch(case: str, call: Callable[[], object]) -> None:
    """Run ``call``, which must raise ``ts.ShapeMismatchError`` on this rank; print its marker.

    Prints ``MISMATCH case=<case> rank=<r> msg=<message>``, then clears the job's wait status and
    meets the other ranks, so that one job can check several ops. That is sound on the CPU path
    only, where every op's kernels ran to their end on all ranks before the error was raised and
    the next op uses other buffers; a real program ends the job after the error.

    Args:
        case: the name printed in the marker.
        call: the disagreeing call.

    Raises:
        AssertionError: ``call`` returned without the error.
    """
    try:
        call()
    except ts.ShapeMismatchError as err:
        print(f"MISMATCH case={case} rank={ts.rank()} msg={err}", flush=True)
    else:
        raise AssertionError(f"rank {ts.rank()}: {case}: no ShapeMismatchError")
    ts.current().wait_status.zero_()
    ts.barrier()
