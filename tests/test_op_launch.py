"""Native launches (``tilescale.op_launch``, ``tilescale/csrc/launcher.cpp``): how a kernel's
parameter bytes are told apart, where a call's arguments stand, and the C++ launcher's writes.

The GPU side (captures, ``cuLaunchKernelEx``, every native launch's bytes compared with the entry
function's, results against torch's, graph replays) runs in ``tests/ranks/native_launch_check.py``."""

import ctypes
import struct
import textwrap

import pytest
import torch
from cpu_jobs import run_python

from tilescale import op_launch
from tilescale.native import launcher_module, launcher_unavailable
from tilescale.op_launch import (
    PACK_ALIGN,
    OpLaunch,
    Output,
    ParamMap,
    map_params,
    packed_layout,
    perturbed,
    places_of,
    scalar_bytes,
)
from tilescale.ops.moe.fp8 import packed_width, pair_views, unpack

A, B = 0x7F00_0000_1000, 0x7F00_0020_0000  # two tensor arguments' addresses
MAP_A = bytes([0xA5]) * 8 + A.to_bytes(8, "little") + bytes(112)  # a "TMA descriptor" that holds A


def holds(tensor_map: bytes, address: int) -> bool:
    return tensor_map[8:16] == address.to_bytes(8, "little")


def blob_of(params, values) -> bytes:
    out = bytearray(max(o + s for o, s in params))
    for (o, s), v in zip(params, values, strict=True):
        out[o:o + s] = v
    return bytes(out)


# A kernel's parameters as TVM lays them out: TMA descriptor, pointer, pointer, int64, int32.
PARAMS = [(0, 128), (128, 8), (136, 8), (144, 8), (152, 4)]


def launch_bytes(ident: int, rows: int = 128) -> bytes:
    return blob_of(PARAMS, [MAP_A, B.to_bytes(8, "little"), (0x1234).to_bytes(8, "little"),
                            scalar_bytes(ident, 8), scalar_bytes(rows, 4)])


IDENT = (5 << 32) | 123


def test_parameters_are_found_by_descriptor_address_and_change():
    moved = {8: (IDENT, perturbed(IDENT, 0))}
    found = map_params(PARAMS, launch_bytes(IDENT), launch_bytes(perturbed(IDENT, 0)), {0: A, 3: B}, moved, holds)
    # A is in a descriptor, B a pointer, the ident the 8-byte scalar; 0x1234 (a hidden table) and rows stay.
    assert found == ParamMap(pointers=((3, 128),), tensor_maps=((0, 0),), scalars=((8, 144, 8),))


def test_what_cannot_be_told_apart_is_said():
    moved = {8: (IDENT, perturbed(IDENT, 0))}
    changed = bytearray(launch_bytes(perturbed(IDENT, 0)))
    changed[152] ^= 1  # a parameter no scalar explains changed too
    assert "changed with 0 scalars" in map_params(PARAMS, launch_bytes(IDENT), bytes(changed), {0: A}, moved, holds)
    same = launch_bytes(perturbed(IDENT, 0))
    assert "one address" in map_params(PARAMS, launch_bytes(IDENT), same, {0: A, 1: A}, moved, holds)
    assert "empty tensor" in map_params(PARAMS, launch_bytes(IDENT), same, {0: 0}, moved, holds)
    # A tensor argument found in no parameter: one the kernel does not take, or takes in a form
    # not recognised (OpLaunch captures the launch with it elsewhere in memory to tell which).
    assert map_params(PARAMS, launch_bytes(IDENT), same, {0: A, 5: 0x9999000}, moved, holds).unplaced == (5,)


def test_a_scalar_the_kernel_does_not_take_is_left_out():
    # TileLang drops a parameter the kernel never reads (the routing kernel's bad_host where it
    # runs in several chunks): the scalar changed no byte, and each call's value goes nowhere.
    moved = {8: (IDENT, perturbed(IDENT, 0)), 9: (7, perturbed(7, 1))}
    found = map_params(PARAMS, launch_bytes(IDENT), launch_bytes(perturbed(IDENT, 0)), {0: A, 3: B}, moved, holds)
    assert found == ParamMap(pointers=((3, 128),), tensor_maps=((0, 0),), scalars=((8, 144, 8),))


def test_scalar_bytes_wrap():
    assert scalar_bytes(-1, 4) == b"\xff\xff\xff\xff"
    assert scalar_bytes((1 << 40) + 3, 8) == ((1 << 40) + 3).to_bytes(8, "little")
    assert perturbed(5, 0) != 5 and perturbed(5, 0) != perturbed(5, 1)


def test_a_calls_arguments_are_placed_and_views_of_them_refused():
    fixed = torch.zeros(4)
    a, w, out = torch.ones(3), torch.ones(2), torch.empty(3)

    def arguments(t, o, s):
        return (t[0], t[1], fixed, o[0], 7, s[0])

    full = (*arguments((a, w), (out,), (IDENT,)), "hidden", 0x1234)
    places = places_of(arguments, full, (a, w), (out,), (IDENT,))
    assert places.tensor_number == {0: 0, 1: 1, 3: 2} and places.scalar_number == {5: 0}
    assert places.values == {5: IDENT} and places.addresses[3] == out.data_ptr()
    assert places.ordered(places.addresses, places.values, 3, 1) == ([a.data_ptr(), w.data_ptr(), out.data_ptr()],
                                                                     [IDENT])
    # One kernel of several takes some of the call's tensors and scalars: the rest stand nowhere in it.
    places = places_of(lambda t, o, s: (o[0], s[1], 3), (out, 9, 3, "hidden"), (a, w), (out,), (IDENT, 9))
    assert places.tensor_number == {0: 2} and places.scalar_number == {1: 1}
    assert places.ordered(places.addresses, places.values, 3, 2) == ([0, 0, out.data_ptr()], [0, 9])
    # An output passed reshaped stands where its view is.
    view = out.view(3, 1)
    places = places_of(lambda t, o, s: (t[0], view, s[0]), (a, view, IDENT), (a,), (out,), (IDENT,))
    assert places.tensor_number == {0: 0, 1: 1} and places.addresses[1] == out.data_ptr()
    # A view elsewhere in an output's memory: its address would change unseen with each call's output.
    assert places_of(lambda t, o, s: (t[0], o[0], o[0][1:], s[0]), (a, out, out[1:], IDENT),
                     (a,), (out,), (IDENT,)) is None
    # A tensor passed twice, as itself and as a view at its address (a two-shot reduction's
    # source and its first row): it stands at its first index, its address written at both.
    rows = torch.ones(4, 2)
    places = places_of(lambda t, o, s: (t[0], t[0][:1], s[0]), (rows, rows[:1], IDENT), (rows,), (), (IDENT,))
    assert places.tensor_number == {0: 0} and places.also == {1: 0} and places.every_index() == {0: 0, 1: 0}
    assert places.ordered(places.addresses, places.values, 1, 1) == ([rows.data_ptr()], [IDENT])
    # A view past its start is refused even beside the tensor itself.
    assert places_of(lambda t, o, s: (t[0], t[0][1:], s[0]), (rows, rows[1:], IDENT), (rows,), (), (IDENT,)) is None


def test_mode_is_checked_and_restored():
    previous = op_launch.set_mode("0")
    try:
        assert op_launch.mode() == "0"
        with pytest.raises(ValueError, match="native launch mode"):
            op_launch.set_mode("fast")
    finally:
        op_launch.set_mode(previous)
    assert op_launch.mode() == previous


@pytest.fixture(scope="module")
def launcher():
    module = launcher_module()
    if module is None:
        pytest.fail(f"the C++ launcher did not build: {launcher_unavailable()}")
    return module


def test_launcher_writes_addresses_and_scalars_where_learned(launcher):
    params = [(0, 8), (8, 8), (16, 8), (24, 4)]
    blob = blob_of(params, [bytes(8), (0x1234).to_bytes(8, "little"), bytes(8), bytes(4)])
    native = launcher.Launcher(0, [1, 1, 1], [128, 1, 1], 0, [], [o for o, _ in params], blob,
                               [(0, 0), (1, 16)], [], [(0, 24, 4)], 2, 1)
    assert native.write([A, B], [(1 << 33) + 7])  # a 4-byte scalar keeps the low bytes
    assert native.blob() == blob_of(params, [A.to_bytes(8, "little"), (0x1234).to_bytes(8, "little"),
                                             B.to_bytes(8, "little"), struct.pack("<I", 7)])
    with pytest.raises(RuntimeError, match="2 addresses expected"):
        native.write([A], [1])
    with pytest.raises(RuntimeError, match="outside the parameters"):
        launcher.Launcher(0, [1, 1, 1], [1, 1, 1], 0, [], [0], bytes(8), [(0, 4)], [], [], 1, 0)
    with pytest.raises(RuntimeError, match="names argument 1 of 1"):
        launcher.Launcher(0, [1, 1, 1], [1, 1, 1], 0, [], [0], bytes(8), [(1, 0)], [], [], 1, 0)
    # A call passes every scalar, those the kernel does not take (in no parameter) too.
    unused = launcher.Launcher(0, [1, 1, 1], [1, 1, 1], 0, [], [0], bytes(8), [(0, 0)], [], [], 1, 1)
    assert unused.write([A], [99]) and unused.blob() == A.to_bytes(8, "little")


def test_launcher_without_a_driver_says_so(launcher):
    if not launcher.driver_missing():
        pytest.skip("this host has a CUDA driver: the GPU rank program launches")
    native = launcher.Launcher(0, [1, 1, 1], [1, 1, 1], 0, [], [0, 8], bytes(16), [(0, 0), (1, 8)], [], [], 2, 0)
    with pytest.raises(RuntimeError, match="libcuda"):
        launcher.Program([native], [([2], None, -1)], 0).call([torch.zeros(2)], [], 0)


class _Runtime:
    last_kernel_spans: tuple = ()


def test_a_site_runs_the_program_learned_on_the_tensors_layouts_with_the_next_call_number(launcher):
    # Direct's C++ half: a call whose tensors have the layouts a program was learned on writes the
    # call's identity, (the group's next call number << 32) | signature, as the kernel's scalar and
    # takes that number; any other layout does nothing and returns NotImplemented.
    if not launcher.driver_missing():
        pytest.skip("this host has a CUDA driver: the GPU rank programs run the direct calls")
    step = launcher.Launcher(0, [1, 1, 1], [1, 1, 1], 0, [], [0, 8], bytes(16), [(0, 0)], [], [(0, 8, 8)], 3, 1)
    program = launcher.Program([step], [([2, 3], None, -1)], 0)
    counter, rt, spans = ctypes.c_int64(41), _Runtime(), (("rows", 0x1000, 64, 2),)
    site = launcher.Site(counter)
    a, w = torch.zeros(2, 4), torch.zeros(3, 4)
    site.add([a, w], program, 0x1234, rt, spans)
    with pytest.raises(RuntimeError, match="libcuda"):  # written, then launched: no driver on this host
        site.call([a, w], 0)
    assert counter.value == 42 and rt.last_kernel_spans == spans
    assert step.blob() == struct.pack("<qq", a.data_ptr(), (42 << 32) | 0x1234)
    for other in ([a.double(), w], [torch.zeros(2, 5), w], [torch.zeros(4, 2).t(), w], [a], [a, w, a]):
        assert site.call(other, 0) is NotImplemented
    assert counter.value == 42 and site.covers([a, w]) and not site.covers([a.double(), w]) and len(site) == 1
    counter.value = 0x7FFFFFFF  # call numbers wrap as call_identity's do
    with pytest.raises(RuntimeError, match="libcuda"):
        site.call([a, w], 0)
    assert counter.value == 1
    with pytest.raises(RuntimeError, match="32 bits"):
        site.add([a], program, 1 << 32, rt, ())


def test_a_site_writes_the_calls_scalars_before_its_identity(launcher):
    # A dispatch passes its id-check word before the identity; a site without a counter (a combine,
    # whose one scalar is its signature) writes the call's scalars alone.
    if not launcher.driver_missing():
        pytest.skip("this host has a CUDA driver: the GPU rank programs run the direct calls")
    step = launcher.Launcher(0, [1, 1, 1], [1, 1, 1], 0, [], [0, 8, 16], bytes(24), [(0, 0)], [],
                             [(0, 8, 8), (1, 16, 8)], 2, 2)
    counter, x = ctypes.c_int64(6), torch.zeros(3)
    site = launcher.Site(counter)
    site.add([x], launcher.Program([step], [([2], None, -1)], 0), 0x55, _Runtime(), ())
    with pytest.raises(RuntimeError, match="libcuda"):
        site.call([x], 0, [0xABC])
    assert step.blob() == struct.pack("<qqq", x.data_ptr(), 0xABC, (7 << 32) | 0x55) and counter.value == 7
    with pytest.raises(RuntimeError, match="2 scalars expected"):  # nothing written, no number taken
        site.call([x], 0)
    assert counter.value == 7
    local = launcher.Site(None)
    local.add([x], launcher.Program([step], [([2], None, -1)], 0), -1, _Runtime(), ())
    with pytest.raises(RuntimeError, match="libcuda"):
        local.call([x], 0, [0xDEF, 0x77])
    assert step.blob() == struct.pack("<qqq", x.data_ptr(), 0xDEF, 0x77) and counter.value == 7


def test_a_site_without_a_counter_runs_programs_that_take_no_scalar(launcher):
    # A rank-local op (grouped_gemm) has no call identity: its site takes no call number.
    site = launcher.Site(None)
    x = torch.zeros(4, 8)
    site.add([x], launcher.Program([], [([2, 2], None, -1)], 0), -1, _Runtime(), ())
    made = launcher.direct_calls()
    assert site.call([x], 0).shape == (2, 2) and launcher.direct_calls() == made + 1
    assert site.call([x.half()], 0) is NotImplemented and launcher.direct_calls() == made + 1
    with pytest.raises(RuntimeError, match="without a call counter"):
        site.add([x], launcher.Program([], [], 0), 5, _Runtime(), ())
    with pytest.raises(RuntimeError, match="32 bits"):
        launcher.Site(ctypes.c_int64(0)).add([x], launcher.Program([], [], 0), -1, _Runtime(), ())


def test_direct_calls_number_their_calls_with_the_groups_python_calls(tmp_path):
    # A site takes its call numbers from the group's counter, which call_identity numbers the
    # op path's calls with: the two paths' calls are numbered in one sequence, as the peers'
    # kernels check them. A failed wait recorded before a call: nothing made, no number taken.
    script = tmp_path / "site.py"
    script.write_text(textwrap.dedent("""
        import torch
        import tilescale as ts
        from tilescale import runtime
        from tilescale.native import launcher_module
        from tilescale.ops._common import call_identity

        ts.init(device="cpu")
        module = launcher_module()
        state = ts.group_state(None)
        site = module.Site(state.call_counter)
        x = torch.zeros(3)
        site.add([x], module.Program([], [([2], torch.int32, -1)], 0), 5, runtime.current(), ())
        assert call_identity(state, 5)[1] == (1 << 32) | 5
        assert site.call([x], 0).shape == (2,) and state.call_counter.value == 2
        assert call_identity(state, 5)[1] == (3 << 32) | 5
        state.wait_status[0] = 1
        try:
            site.call([x], 0)
            raise AssertionError("a direct call after a failed wait went through")
        except module.DeviceWaitFailed:
            pass
        assert state.call_counter.value == 3
        state.wait_status[0] = 0
        print("SITE-OK", module.direct_calls())
        ts.finalize()
    """))
    proc = run_python(script, timeout=200)
    assert "SITE-OK 1" in proc.stdout, proc.stdout + proc.stderr


def test_launcher_takes_descriptors_off_a_64_byte_boundary_if_they_agree(launcher):
    # A kernel's parameter space starts off 64 bytes: its descriptors sit at 112, 240, ... (GPU runs).
    launcher.Launcher(0, [1, 1, 1], [1, 1, 1], 0, [], [112, 240], bytes(368), [], [(0, 112), (1, 240)], [], 2, 0)
    with pytest.raises(RuntimeError, match="agree modulo 64"):
        launcher.Launcher(0, [1, 1, 1], [1, 1, 1], 0, [], [112, 256], bytes(384), [], [(0, 112), (1, 256)], [], 2,
                          0)


def test_packed_outputs_are_aligned_views_of_one_allocation(launcher):
    outputs = [Output((3,), torch.int32, packed=True), Output((2, 4)), Output((5, 100), torch.float32, packed=True),
               Output((0,), torch.int32, packed=True)]
    offsets, size = packed_layout(outputs)
    assert offsets == [0, -1, PACK_ALIGN, 9 * PACK_ALIGN] and size == 10 * PACK_ALIGN  # 2000 bytes: 8 units; empty: 1
    with pytest.raises(ValueError, match="needs its dtype"):
        packed_layout([Output((3,), packed=True)])
    # The C++ program lays them out alike (a program of no kernels: only its outputs).
    program = launcher.Program([], [(list(o.shape), o.dtype, at) for o, at in zip(outputs, offsets, strict=True)], size)
    x = torch.zeros(2, dtype=torch.bfloat16)
    made = program.call([x], [], 0)
    assert [(t.shape, t.dtype) for t in made] == [(torch.Size([3]), torch.int32), (torch.Size([2, 4]), torch.bfloat16),
                                                 (torch.Size([5, 100]), torch.float32), (torch.Size([0]), torch.int32)]
    # Allocated without the dispatcher, each behaves as torch.empty's would.
    own = made[1]
    assert own.is_contiguous() and own.device == x.device and own.untyped_storage().nbytes() == 16
    assert not own.requires_grad and torch.equal(own.fill_(2) + torch.ones(2, 4), torch.full((2, 4), 3.0))
    base = made[0].data_ptr()
    assert [made[0].data_ptr() - base, made[2].data_ptr() - base] == [offsets[0], offsets[2]]
    assert made[0].untyped_storage().data_ptr() == made[2].untyped_storage().data_ptr() != made[1].data_ptr()
    made[2].fill_(1.5)  # a view of its own bytes: the others keep theirs
    made[0].fill_(7)
    assert made[2].sum().item() == 750 and made[0].tolist() == [7, 7, 7]
    with pytest.raises(RuntimeError, match="does not fit"):
        launcher.Program([], [([3], torch.int32, PACK_ALIGN)], PACK_ALIGN)


def test_scratch_outputs_are_written_where_packed_and_not_returned(launcher):
    # A re-dispatch's grouped layout: packed outputs the kernels write, the call does not return.
    outputs = [Output((3,), torch.int32, packed=True), Output((4,), torch.int32, packed=True, returned=False),
               Output((2, 4), torch.bfloat16)]
    offsets, size = packed_layout(outputs)
    spec = [(list(o.shape), o.dtype, at) for o, at in zip(outputs, offsets, strict=True)]
    views = [(2, [4, 2], [1, 4], 0, torch.bfloat16)]  # of the output after the scratch one: numbered as declared
    kept, own, transposed = launcher.Program([], spec, size, views, [1]).call([torch.zeros(2)], [], 0)
    assert (kept.shape, own.shape, transposed.shape) == ((3,), (2, 4), (4, 2))
    assert transposed.data_ptr() == own.data_ptr() and transposed.stride() == (1, 4)
    assert launcher.Program([], spec, size, [], [0, 1]).call([torch.zeros(2)], [], 0).shape == (2, 4)  # the one left
    # The kernels get every output's address: the scratch one's inside the packed bytes.
    if launcher.driver_missing():
        step = launcher.Launcher(0, [1, 1, 1], [1, 1, 1], 0, [], [0, 8], bytes(16), [(1, 0), (2, 8)], [], [], 4, 0)
        with pytest.raises(RuntimeError, match="libcuda"):  # written, then launched: no driver on this host
            launcher.Program([step], spec, size, [], [1]).call([torch.zeros(2)], [], 0)
        first, scratch = struct.unpack("<qq", step.blob())
        assert scratch - first == offsets[1] - offsets[0]
    with pytest.raises(RuntimeError, match="scratch output is a packed"):
        launcher.Program([], spec, size, [], [2])
    with pytest.raises(ValueError, match="not returned is a packed"):
        OpLaunch([], [Output((2, 4), torch.int32, returned=False)])


def layout(t: torch.Tensor) -> tuple:
    return t.shape, t.dtype, t.stride(), t.storage_offset(), t.untyped_storage().data_ptr()


def test_views_of_an_output_are_made_as_fp8_unpack_makes_them(launcher):
    # An FP8 dispatch's grouped bytes (4 rows of 256 values and 2 scales) and their (values, scales).
    hidden, width = 256, packed_width(256)
    views = [(v.of, list(v.shape), list(v.strides), v.offset, v.dtype) for v in pair_views(0, 4, hidden)]
    program = launcher.Program([], [([4, width], torch.uint8, -1)], 0, views)
    rows, values, scales = program.call([torch.zeros(1)], [], 0)
    want = unpack(rows, hidden)
    assert [layout(values), layout(scales)] == [layout(want[0]), layout(want[1])]
    rows.view(torch.float32)[:, hidden // 4:] = 3.0  # the scales' bytes, seen through the view
    assert torch.equal(scales, torch.full((4, 2), 3.0))
    past = [(0, [4, 3], [width // 4, 1], hidden // 4, torch.float32)]  # a third scale: past the last row's end
    with pytest.raises(RuntimeError, match="reaches past"):
        launcher.Program([], [([4, width], torch.uint8, -1)], 0, past)
    with pytest.raises(RuntimeError, match="allocation of its own"):
        launcher.Program([], [([4, width], torch.uint8, 0)], 4 * width, views)


def test_the_entry_path_lays_packed_outputs_out_as_the_program_does(tmp_path):
    # The call through the entry functions (CPU path, learning calls) allocates in Python: the same
    # offsets as packed_layout's, which the C++ program's follow (the test above).
    script = tmp_path / "allocate.py"
    script.write_text(textwrap.dedent("""
        import torch
        import tilescale as ts
        from tilescale.op_launch import OpLaunch, Output, packed_layout
        from tilescale.ops.moe.fp8 import packed_width, pair_views, unpack

        ts.init(device="cpu")
        outputs = [Output((3,), torch.int32, packed=True), Output((2, 4)), Output((5, 100), torch.float32, packed=True),
                   Output((7, 2), torch.int32, packed=True)]
        made = OpLaunch([], outputs)._allocate([torch.zeros(2, dtype=torch.bfloat16)])
        offsets, _ = packed_layout(outputs)
        base = made[0].data_ptr()
        assert [(t.shape, t.dtype) for t in made] == [((3,), torch.int32), ((2, 4), torch.bfloat16),
                                                     ((5, 100), torch.float32), ((7, 2), torch.int32)]
        assert [t.data_ptr() - base for t in (made[0], made[2], made[3])] == [offsets[0], offsets[2], offsets[3]]
        assert all(t.is_contiguous() for t in made)
        assert made[0].untyped_storage().data_ptr() == made[3].untyped_storage().data_ptr()
        # Views of an output: an FP8 dispatch's grouped bytes as (values, scales), as unpack makes them.
        hidden, width = 256, packed_width(256)
        call = OpLaunch([], [Output((4, width), torch.uint8)], views=pair_views(0, 4, hidden))
        rows, values, scales = call([torch.zeros(1)])
        want = unpack(rows, hidden)
        for got, made in ((values, want[0]), (scales, want[1])):
            assert (got.shape, got.dtype, got.stride(), got.storage_offset()) == (
                made.shape, made.dtype, made.stride(), made.storage_offset())
            assert got.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()
        try:
            OpLaunch([], [Output((4, width), torch.uint8, packed=True)], views=call.views)
            raise AssertionError("a view of a packed output was taken")
        except ValueError as e:
            assert "allocation of its own" in str(e)
        print("ALLOCATE-OK")
        ts.finalize()
    """))
    proc = run_python(script, timeout=120)
    assert "ALLOCATE-OK" in proc.stdout, proc.stdout + proc.stderr


def test_a_program_launches_nothing_once_a_live_groups_wait_record_reports_a_failure(tmp_path):
    # Before it launches, every native call reads each live group's wait-status record (groups
    # made later too, released ones no longer), as the entry path's check_device_waits does;
    # OpLaunch then raises that check's message (the GPU side: tests/ranks/native_launch_check.py).
    script = tmp_path / "waits.py"
    script.write_text(textwrap.dedent("""
        import torch
        import tilescale as ts
        from tilescale.native import launcher_module

        ts.init(device="cpu")
        module = launcher_module()
        program = module.Program([], [([2], torch.int32, -1)], 0)
        x = torch.zeros(1)

        def refused():
            try:
                program.call([x], [], 0)
            except module.DeviceWaitFailed:
                return True
            return False

        whole = ts.group_state(None)
        assert not refused()
        whole.wait_status[0] = 1
        assert refused()
        whole.wait_status[0] = 0
        later = ts.group_state(ts.new_group([0]))
        later.wait_status[0] = 1
        assert refused()
        later.release()
        assert not refused()
        whole.wait_status[0] = 1
        try:
            ts.finalize()
            raise AssertionError("finalize did not report the failed wait")
        except ts.WaitTimeoutError:
            pass
        assert not refused()  # no runtime: no records read
        print("WAITS-OK")
    """))
    proc = run_python(script, timeout=200)
    assert "WAITS-OK" in proc.stdout, proc.stdout + proc.stderr
