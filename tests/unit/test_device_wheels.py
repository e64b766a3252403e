"""The device check's wheelhouse (pipeline.bench.device): one requirement per carried package, at the
version installed here unless WHEELS pins another (one whose cp312 wheel exists)."""

from __future__ import annotations

from importlib.metadata import version

from pipeline.bench import device


def test_each_carried_package_is_pinned_once():
    specs = device.wheel_specs()
    names = [spec.split("==")[0] for spec in specs]
    assert len(set(names)) == len(names) == len(device.WHEELS)
    for entry, spec in zip(device.WHEELS, specs):
        name, _, pin = entry.partition("==")
        assert spec == f"{name}=={pin or version(name)}"
    assert "zstd==1.5.6.1" in specs  # the newest zstd with a cp312 manylinux wheel
