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


def exchange_states() -> dict[tuple, list[int]]:
    """The device-counted state of every fused TP GEMM exchange of the whole job's group:
    ``[calls, flag target, blocks counted in]`` (``tilescale.ops.tp_gemm.exchange._Exchange``).

    Example::

        before = exchange_states()
        ts.ops.gemm_all_reduce(a, w, plan="fused")
        after = exchange_states()     # one exchange: one more call, blocks counted in back to 0
    """
    from tilescale.ops.tp_gemm.exchange import _Exchange

    return {key: ex.state.tolist() for key, ex in ts.group_state().exchanges.items() if isinstance(ex, _Exchange)}


def counted_calls(op: Callable[[], object], calls: int) -> tuple[int, int]:
    """Run ``op`` (a fused TP GEMM call whose plan is built) ``calls`` times and check that only
    its own kernels count them: one exchange advances by exactly ``calls`` calls (blocks
    counted in back at 0) and no torch operation outside a kernel touches its state.

    Example::

        step, kernels = counted_calls(lambda: ts.ops.gemm_all_reduce(a, w, plan="fused"), 5)

    Args:
        op: the call, run as it is (its plan already built by an earlier call).
        calls: how many times to run it.

    Returns:
        What each call added to the exchange's flag target, and the kernels each call launched.

    Raises:
        AssertionError: another count, or a host operation on the state.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from tilescale.jit import DistributedKernel
    from tilescale.op_launch import OpLaunch
    from tilescale.ops.tp_gemm.exchange import _Exchange

    states = [ex.state for ex in ts.group_state().exchanges.values() if isinstance(ex, _Exchange)]
    storages = {s.untyped_storage().data_ptr() for s in states}
    inside, launched, touched = [False], [0], []

    class HostOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside[0]:
                flat = torch.utils._pytree.tree_leaves((args, kwargs))
                if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in storages for t in flat):
                    touched.append(str(func))
            return func(*args, **(kwargs or {}))

    def counting(launch):
        def counted(self, *args, **kwargs):  # the kernels themselves run as always
            launched[0] += len(self.steps) if isinstance(self, OpLaunch) else 1
            inside[0] = True
            try:
                return launch(self, *args, **kwargs)
            finally:
                inside[0] = False
        return counted

    # A kernel is launched by its call, or by an op's OpLaunch (its kernels; from C++ once learned).
    launches = {cls: cls.__call__ for cls in (DistributedKernel, OpLaunch)}
    before = exchange_states()
    for cls, launch in launches.items():
        cls.__call__ = counting(launch)
    try:
        with HostOps():
            for _ in range(calls):
                op()
    finally:
        for cls, launch in launches.items():
            cls.__call__ = launch
    after = exchange_states()
    changed = [key for key in after if after[key] != before.get(key)]
    assert len(changed) == 1, (before, after)
    delta = [a - b for a, b in zip(after[changed[0]], before.get(changed[0], [0, 0, 0]), strict=True)]
    assert delta[0] == calls and delta[2] == 0 and delta[1] > 0 and delta[1] % calls == 0, delta
    assert not touched, f"host operations on an exchange's state: {touched}"
    assert launched[0] % calls == 0, launched
    return delta[1] // calls, launched[0] // calls
