"""The CPU execution path: examples with 2 and 4 ranks, and the debugging checks the GPU lacks."""

import re
import subprocess
import textwrap
import time
from collections.abc import Callable

import pytest
from cpu_jobs import RANKS, example_output, run_cpu, run_examples, run_python

EXAMPLES = ["symmetric_tensors", "ring_shift", "all_gather", "all_reduce", "reduce_scatter", "tp_mlp_training",
            "moe_layer", "moe_training", "moe_decode_graph"]


@pytest.fixture(scope="module")
def examples_job() -> Callable[[int], subprocess.CompletedProcess]:
    """One job per rank count runs every example: its ranks start once, not once per example."""
    jobs = {}

    def job(n: int) -> subprocess.CompletedProcess:
        if n not in jobs:
            jobs[n] = run_examples(n, EXAMPLES)
        return jobs[n]

    return job


@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("example", EXAMPLES)
def test_example_on_the_cpu_path(examples_job, example, n):
    proc = examples_job(n)
    outputs = [example_output(proc.stdout, rank, example) for rank in range(n)]
    assert None not in outputs, f"{example} did not finish on every rank:\n" + proc.stdout[-2000:] + proc.stderr[-3000:]
    assert any("correct" in out for out in outputs), "\n".join(outputs)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", [2, 4])
def test_examples_job_exits_cleanly(examples_job, n):
    proc = examples_job(n)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.timeout(180)
def test_all_gather_example_is_quick():
    """1 MiB per rank, 2 ranks: the example's work, timed inside each rank after its imports
    (tests/ranks/all_gather_timed.py), within 5 s."""
    proc = run_cpu(str(RANKS / "all_gather_timed.py"), 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all_gather of 1 MiB per rank correct" in proc.stdout
    work = [float(s) for s in re.findall(r"WORK-S ([0-9.]+)", proc.stdout)]
    assert len(work) == 2 and max(work) < 5, work


@pytest.mark.timeout(120)
def test_out_of_bounds_accesses_raise_index_error():
    proc = run_cpu(str(RANKS / "out_of_bounds.py"), 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        peer = (rank + 1) % 2
        assert (f"rank {rank}: IndexError: rank {rank}: B on rank {peer} index 24 out of bounds in dimension 0 "
                "(shape (16, 8))") in proc.stdout
        assert f"rank {rank}: IndexError: rank {rank}: A index 16 out of bounds in dimension 0 (shape (16,))" \
            in proc.stdout
    assert "out_of_bounds.py:15)" in proc.stdout  # the kernel line of the remote copy
    assert "out_of_bounds.py:26)" in proc.stdout  # the kernel line of the store


@pytest.mark.timeout(120)
def test_missing_signal_reports_the_wait_graph():
    start = time.monotonic()
    proc = run_cpu(str(RANKS / "wait_timeout.py"), 2, env={"TILESCALE_WAIT_TIMEOUT_S": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.monotonic() - start < 60
    out = proc.stdout
    assert "rank 0: WaitTimeoutError: rank 0: T.wait(flags[1] >= 1) in block 0 timed out after 2 s (observed 0)" in out
    # rank 0's message lists what every rank was waiting for at that moment
    line = next(ln for ln in out.splitlines() if "rank 0: WaitTimeoutError" in ln)
    assert "Pending waits: rank 0: T.wait(flags[1] >= 1) in block 0; rank 1: T.barrier()" in line
    assert "rank 1: WaitTimeoutError: rank 1: T.barrier()" in out


@pytest.mark.timeout(200)
def test_a_rank_building_kernels_slower_than_the_wait_bound_is_waited_for_on_the_host():
    """Rank 1 takes 3 s per kernel build, the wait bound is 1 s: every collective op, fused
    TP GEMM and MoE dispatch + combine still agrees (without the host barrier at a plan's first
    call, the first all_gather, and later the first MoE dispatch, timed out on the device)."""
    proc = run_cpu(str(RANKS / "build_skew.py"), 2,
                   env={"TILESCALE_WAIT_TIMEOUT_S": "1", "TILESCALE_TEST_BUILD_DELAY_S": "3"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for op in ("all_gather", "all_reduce", "reduce_scatter", "all_gather_gemm", "gemm_reduce_scatter",
               "gemm_all_reduce", "moe_dispatch_combine"):
        for rank in (0, 1):
            assert f"SKEW-OK {op} rank={rank}" in proc.stdout, (op, rank, proc.stdout[-2000:])


@pytest.mark.timeout(120)
def test_unsupported_construct_names_itself_and_its_line(tmp_path):
    script = tmp_path / "unsupported.py"
    script.write_text(textwrap.dedent("""
        import torch
        import tilescale as ts
        import tilescale.language as T

        @ts.jit
        def nested(N):
            @T.prim_func
            def main(A: T.Tensor((N, 4), "float32")):
                with T.Kernel(1, threads=128):
                    for i in T.Parallel(N):
                        for k in T.serial(i):
                            A[i, k] = A[i, k] + 1

            return main

        @ts.jit
        def per_thread(N):
            @T.prim_func
            def main(A: T.Tensor((N,), "float32")):
                with T.Kernel(1, threads=128):
                    tx = T.get_thread_binding()
                    A[tx] = 1.0

            return main

        ts.init(device="cpu")
        try:
            nested(8)(torch.zeros(8, 4))
        except NotImplementedError as err:
            print("NotImplementedError:", err)
        try:
            per_thread(128)(torch.zeros(128))
        except NotImplementedError as err:
            print("NotImplementedError:", err)
    """))
    proc = run_python(script, timeout=100, cwd=tmp_path)
    assert ("NotImplementedError: CPU path: a loop inside T.Parallel whose bounds differ per element is not supported"
            in proc.stdout), proc.stdout + proc.stderr
    assert "unsupported.py:12)" in proc.stdout
    assert "NotImplementedError: CPU path: thread-level code (T.get_thread_binding / threadIdx)" in proc.stdout


@pytest.mark.timeout(120)
def test_single_process_kernels_compute(tmp_path):
    """Tile GEMM (transposed B), reductions, fills and parallel math give torch's results."""
    script = tmp_path / "compute.py"
    script.write_text(textwrap.dedent("""
        import torch
        import tilescale as ts
        import tilescale.language as T

        @ts.jit
        def gemm_softmax_rows(M, N, K):
            @T.prim_func
            def main(A: T.Tensor((M, K), "float16"), B: T.Tensor((N, K), "float16"),
                     C: T.Tensor((M, N), "float32"), S: T.Tensor((M,), "float32")):
                with T.Kernel(2, threads=128) as bx:
                    a = T.alloc_shared((M // 2, K), "float16")
                    b = T.alloc_shared((N, K), "float16")
                    c = T.alloc_fragment((M // 2, N), "float32")
                    m = T.alloc_fragment((M // 2,), "float32")
                    s = T.alloc_fragment((M // 2,), "float32")
                    T.copy(A[bx * (M // 2), 0], a)
                    T.copy(B, b)
                    T.clear(c)
                    for k in T.Pipelined(2, num_stages=2):
                        T.gemm(a[:, k * (K // 2):(k + 1) * (K // 2)], b[:, k * (K // 2):(k + 1) * (K // 2)], c,
                               transpose_B=True)
                    T.reduce_max(c, m, dim=1)
                    for i, j in T.Parallel(M // 2, N):
                        c[i, j] = T.exp(c[i, j] - m[i])
                    T.reduce_sum(c, s, dim=1)
                    T.copy(c, C[bx * (M // 2), 0])
                    T.copy(s, S[bx * (M // 2)])

            return main

        @ts.jit
        def histogram(N, bins):
            @T.prim_func
            def main(X: T.Tensor((N,), "int32"), H: T.Tensor((bins,), "float32")):
                with T.Kernel(4, threads=128) as bx:
                    for i in T.serial(N // 4):
                        T.atomic_add(H[X[bx * (N // 4) + i]], 1.0)

            return main

        @ts.jit
        def parallel_histogram(N, K, bins):
            # Element atomics inside T.Parallel, masked and not: every element's update lands,
            # also where several elements name one bin (a plain store would keep one).
            @T.prim_func
            def main(X: T.Tensor((N, K), "int32"), H: T.Tensor((bins,), "int32"), M: T.Tensor((bins,), "int32")):
                with T.Kernel(1, threads=128):
                    hist = T.alloc_shared((bins,), "int32")
                    T.fill(hist, 0)
                    for t, k in T.Parallel(N, K):
                        if X[t, k] < bins - 1:
                            T.atomic_add(hist[X[t, k]], 1)
                    for t, k in T.Parallel(N, K):
                        T.atomic_max(M[X[t, k]], t)
                    for e in T.Parallel(bins):
                        H[e] = hist[e]

            return main

        @ts.jit
        def scaled_rows(N, width):
            # Registers padded past the row (as the MoE combine's): the guarded loads and
            # stores past N read and write nothing, as on the GPU.
            @T.prim_func
            def main(X: T.Tensor((2, N), "float32"), Y: T.Tensor((2, N), "float32")):
                with T.Kernel(2, threads=128) as bx:
                    acc = T.alloc_fragment((1, width), "float32")
                    T.clear(acc)
                    for i, c in T.Parallel(1, width):
                        u = c + 0
                        if u < N:
                            acc[i, c] += X[bx, u] * 2.0
                    for i, c in T.Parallel(1, width):
                        if c < N:
                            Y[bx, c] = acc[i, c]

            return main

        @ts.jit
        def row_prefix(N, W):
            # A serial loop inside T.Parallel: each element's steps in order (a prefix along
            # each row, every row at once).
            @T.prim_func
            def main(X: T.Tensor((N, W), "float32")):
                with T.Kernel(1, threads=128):
                    for i in T.Parallel(N):
                        for k in T.serial(1, W):
                            X[i, k] = X[i, k] + X[i, k - 1]

            return main

        ts.init(device="cpu")
        X = torch.randn(6, 5)
        ref = X.cumsum(1)
        row_prefix(6, 5)(X)
        torch.testing.assert_close(X, ref)
        X, Y = torch.randn(2, 40), torch.zeros(2, 40)
        scaled_rows(40, 1024)(X, Y)
        torch.testing.assert_close(Y, 2 * X)
        X, H = torch.randint(0, 8, (64,), dtype=torch.int32), torch.zeros(8)
        histogram(64, 8)(X, H)
        torch.testing.assert_close(H, torch.bincount(X, minlength=8).float())
        X = torch.randint(0, 8, (64, 4), dtype=torch.int32)
        H, M = torch.zeros(8, dtype=torch.int32), torch.full((8,), -1, dtype=torch.int32)
        parallel_histogram(64, 4, 8)(X, H, M)
        want = torch.bincount(X.flatten(), minlength=8).int()
        want[7] = 0  # the masked bin
        torch.testing.assert_close(H, want)
        last = torch.full((8,), -1, dtype=torch.int32)
        for t in range(64):
            last[X[t]] = t
        torch.testing.assert_close(M, last)
        M, N, K = 32, 16, 64
        A, B = torch.randn(M, K).half(), torch.randn(N, K).half()
        C, S = torch.empty(M, N), torch.empty(M)
        gemm_softmax_rows(M, N, K)(A, B, C, S)
        ref = A.float() @ B.float().T
        ref = torch.exp(ref - ref.amax(1, keepdim=True))
        torch.testing.assert_close(C, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(S, ref.sum(1), rtol=1e-4, atol=1e-4)
        print("COMPUTE-OK")
    """))
    proc = run_python(script, timeout=100, cwd=tmp_path)
    assert "COMPUTE-OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.timeout(120)
def test_arguments_unlike_the_kernel_declares_raise(tmp_path):
    """As TileLang's compiled host code on a GPU: a run-time size two tensors give differently, a
    constant size, rank, dtype or layout unlike the declaration raises before the kernel runs."""
    script = tmp_path / "arguments.py"
    script.write_text(textwrap.dedent("""
        import torch
        import tilescale as ts
        import tilescale.language as T

        @ts.jit
        def axpy(width):
            n = T.dynamic("n")

            @T.prim_func
            def main(X: T.Tensor((n, width), "float32"), Y: T.Tensor((n, width), "float32"),
                     P: T.Tensor((n * 2,), "int32")):
                with T.Kernel(1, threads=128):
                    for i, c in T.Parallel(n, width):
                        Y[i, c] += X[i, c] * 2.0

            return main

        ts.init(device="cpu")
        kernel = axpy(4)
        X, Y, P = torch.randn(3, 4), torch.zeros(3, 4), torch.zeros(6, dtype=torch.int32)
        kernel(X, Y, P)
        torch.testing.assert_close(Y, 2 * X)
        bad = {
            "n = 5; an earlier argument gave 3": (X, torch.zeros(5, 4), P),
            "'P': size 7 is not a multiple of 2": (X, Y, torch.zeros(7, dtype=torch.int32)),
            "gives n = 4; an earlier argument gave 3": (X, Y, torch.zeros(8, dtype=torch.int32)),
            "'Y' has size 5 where the kernel declares 4": (X, torch.zeros(3, 5), P),
            "'X' has 1 dimensions; the kernel declares 2": (X.view(-1), Y, P),
            "'Y' is torch.float16; the kernel declares float32": (X, Y.half(), P),
            "'X' is not contiguous": (torch.randn(4, 3).T, Y, P),
        }
        for message, args in bad.items():
            try:
                kernel(*args)
            except (ValueError, TypeError) as error:
                assert message in str(error), (message, error)
            else:
                raise AssertionError(f"no error: {message}")
        torch.testing.assert_close(Y, 2 * X)  # no bad call ran the kernel
        print("ARGUMENTS-OK")
    """))
    proc = run_python(script, timeout=100, cwd=tmp_path)
    assert "ARGUMENTS-OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_ops_match_torch_distributed(n):
    proc = run_cpu(str(RANKS / "ops_check.py"), n)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("OPS-OK") == n


@pytest.mark.timeout(120)
def test_single_gpu_tilelang_programs_run_unchanged():
    proc = run_python(RANKS / "tilelang_programs.py", timeout=100)
    assert "SINGLE-GPU-PROGRAMS-OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.timeout(120)
def test_count_call_counts_each_launch_once(tmp_path):
    """``T.count_call``: every block of a launch gets the same call (number, flag target), the
    launch advances the count once, also when only some blocks count (``blocks``) and when a
    wait in it timed out (the next launch gets the next call)."""
    script = tmp_path / "count.py"
    script.write_text(textwrap.dedent("""
        import torch
        import tilescale as ts
        import tilescale.language as T

        @ts.jit
        def counted(blocks, counting, wait):
            @T.prim_func
            def main(state: T.Tensor((3,), "int32"), seen: T.Tensor((blocks, 2), "int32"),
                     flag: T.Tensor((1,), "int32")):
                with T.Kernel(blocks, threads=128) as b:
                    with T.Scale("device"):
                        if b < counting:
                            call = T.alloc_local((2,), "int32")
                            T.count_call(state, 5, call, counting)
                            seen[b, 0] = call[0]
                            seen[b, 1] = call[1]
                            if wait and b == 0:
                                T.wait(flag[0], "ge", 1)

            return main

        ts.init(device="cpu")
        state, flag = torch.zeros(3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        for i, (blocks, counting) in enumerate(((4, 4), (4, 4), (6, 2)), start=1):
            seen = torch.zeros(blocks, 2, dtype=torch.int32)
            counted(blocks, counting, False)(state, seen, flag)
            assert seen[:counting].tolist() == [[i, 5 * i]] * counting, seen
            assert state.tolist() == [i, 5 * i, 0], state
        try:
            counted(4, 4, True)(state, torch.zeros(4, 2, dtype=torch.int32), flag)
            raise AssertionError("the wait did not time out")
        except ts.WaitTimeoutError:
            ts.current().wait_status.zero_()
        assert state.tolist() == [4, 20, 0], state
        flag[0] = 1
        seen = torch.zeros(4, 2, dtype=torch.int32)
        counted(4, 4, True)(state, seen, flag)
        assert seen.tolist() == [[5, 25]] * 4 and state.tolist() == [5, 25, 0], (seen, state)
        print("COUNT-OK")
    """))
    proc = run_python(script, timeout=100, cwd=tmp_path, env={"TILESCALE_WAIT_TIMEOUT_S": "1"})
    assert "COUNT-OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.timeout(120)
def test_assert_close_raises_a_recorded_device_failure_first(tmp_path):
    """``ts.testing.assert_close`` raises a failure a kernel of this rank recorded (on GPUs a
    timed-out kernel's call returns, its outputs undefined, and the record waits in host
    memory for the next launch) instead of comparing; with none recorded it compares as torch.
    The record is written as ``tilescale::report_failure`` writes it."""
    script = tmp_path / "close.py"
    script.write_text(textwrap.dedent("""
        import torch
        import tilescale as ts
        from tilescale.protocol import COMPARISONS, WAIT
        from tilescale.testing import assert_close

        ts.init(device="cpu")
        out = torch.ones(4)
        flag = torch.zeros(2, dtype=torch.int32)
        # rank 0, block 3 waited for flag[1] >= 8 and saw 5
        ts.current().wait_status.copy_(torch.tensor([1, 0, 3, flag.data_ptr() + 4, COMPARISONS["ge"], 8, 5, WAIT]))
        try:
            assert_close(out, torch.ones(4))  # equal outputs: the recorded timeout still wins
            raise AssertionError("assert_close compared the outputs of a timed-out kernel")
        except ts.WaitTimeoutError as err:
            assert "block 3" in str(err) and ">= 8 (observed 5)" in str(err), err
        ts.current().wait_status.zero_()
        assert_close(out, torch.ones(4))
        try:
            assert_close(out, torch.zeros(4))
            raise RuntimeError("no mismatch reported")
        except AssertionError as err:
            assert "not close" in str(err), err
        ts.finalize()
        assert_close(out, torch.ones(4))  # outside a job: torch's comparison alone
        print("CLOSE-OK")
    """))
    proc = run_python(script, timeout=100, cwd=tmp_path)
    assert "CLOSE-OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
