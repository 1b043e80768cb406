"""Every Python package directory of the project ships in the wheel."""

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for top, name in (("tilescale", "tilescale"), ("comm", "tilescale.comm"), ("launch", "tilescale.launch")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert found == listed


def test_device_code_ships_as_package_data():
    """Every .cuh a lowering includes in generated kernels is package data of its package."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    data = config["package-data"]
    headers = [p for top in ("tilescale", "comm") for p in (ROOT / top).rglob("*.cuh")]
    assert headers, "the NVSHMEM lowering's helpers are a .cuh file"
    for header in headers:
        top, *rest = header.parent.relative_to(ROOT).parts
        package = ".".join(["tilescale", "comm", *rest] if top == "comm" else [top, *rest])
        assert any(header.match(pattern) for pattern in data.get(package, [])), (header, package)
