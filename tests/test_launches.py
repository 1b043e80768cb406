"""Launch templates (``tilescale.launches``): how a kernel's parameter bytes are told apart.

The GPU side (captures, ``cuLaunchKernelEx``, every templated launch compared with the entry
function's parameters) runs in ``tests/ranks/launch_templates_check.py``."""

import struct

import pytest

from tilescale import launches
from tilescale.launches import ParamMap, map_params, perturbed, scalar_bytes

A, B = 0x7F00_0000_1000, 0x7F00_0020_0000  # two tensor arguments' addresses
MAP_A = bytes([0xA5]) * 8 + A.to_bytes(8, "little") + bytes(112)  # a "TMA descriptor" that holds A


def holds(tensor_map: bytes, address: int) -> bool:
    return tensor_map[8:16] == address.to_bytes(8, "little")


def blob_of(params, values) -> bytes:
    out = bytearray(max(o + s for o, s in params))
    for (o, s), v in zip(params, values, strict=True):
        out[o:o + s] = v
    return bytes(out)


# A kernel's parameters as TVM lays them out: pointer, pointer, int32, int64, a TMA descriptor, float32.
PARAMS = [(0, 8), (8, 8), (16, 4), (24, 8), (64, 128), (192, 4)]
SCALARS = {2: 7, 3: (5 << 32) | 123, 5: 0.5}


def launch_bytes(scalars: dict) -> bytes:
    return blob_of(PARAMS, [A.to_bytes(8, "little"), (0x1234).to_bytes(8, "little"), scalar_bytes(scalars[2], 4, False),
                            scalar_bytes(scalars[3], 8, False), MAP_A, struct.pack("<f", scalars[5])])


def test_parameters_are_found_by_address_descriptor_and_change():
    changed = {i: perturbed(v, i) for i, v in SCALARS.items()}
    found = map_params(PARAMS, launch_bytes(SCALARS), launch_bytes(changed), {0: A, 1: B}, SCALARS, holds)
    # B is not in the launch (a hidden pointer 0x1234 stays as it is); A is a pointer and a descriptor.
    assert found == ParamMap(pointers=((0, 0),), tensor_maps=((0, 64),),
                             scalars=((2, 16, 4, False), (3, 24, 8, False), (5, 192, 4, True)))


def test_an_unexplained_change_or_a_shared_address_leaves_the_entry_function():
    changed = {i: perturbed(v, i) for i, v in SCALARS.items()}
    moved = bytearray(launch_bytes(changed))
    moved[8] ^= 1  # a parameter no scalar explains changed too
    assert map_params(PARAMS, launch_bytes(SCALARS), bytes(moved), {0: A}, SCALARS, holds) is None
    # Two arguments at one address: whose parameter it is cannot be told.
    assert map_params(PARAMS, launch_bytes(SCALARS), launch_bytes(changed), {0: A, 1: A}, SCALARS, holds) is None
    # An empty tensor (address 0) names no parameter.
    assert map_params(PARAMS, launch_bytes(SCALARS), launch_bytes(changed), {0: 0}, SCALARS, holds) is None
    # Two scalars whose change would look alike at one parameter.
    same = {2: 7, 3: 7}
    params = [(0, 4), (4, 4)]
    blob = blob_of(params, [scalar_bytes(7, 4, False)] * 2)
    assert map_params(params, blob, blob_of(params, [scalar_bytes(8, 4, False)] * 2), {}, same, holds) is None


def test_scalar_bytes_wrap_and_floats():
    assert scalar_bytes(-1, 4, False) == b"\xff\xff\xff\xff"
    assert scalar_bytes((1 << 40) + 3, 8, False) == ((1 << 40) + 3).to_bytes(8, "little")
    assert scalar_bytes(0.25, 8, True) == struct.pack("<d", 0.25)
    assert perturbed(5, 0) != 5 and perturbed(5, 0) != perturbed(5, 1)


def test_mode_is_checked_and_restored():
    previous = launches.set_mode("0")
    try:
        assert launches.mode() == "0"
        with pytest.raises(ValueError, match="launch template mode"):
            launches.set_mode("fast")
    finally:
        launches.set_mode(previous)
    assert launches.mode() == previous
