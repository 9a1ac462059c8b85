"""models/native.py: kernels built side by side into the cache, once."""

import sys

import pytest

from models import native

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Aerie's C++ kernels are built on Linux")

SOURCE = "extern \"C\" int answer_{n}() {{ return {n}; }}\n"


def test_build_all_compiles_only_the_missing_kernels_and_leaves_failures_to_build(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for n in (1, 2):
        (csrc / f"k{n}.cpp").write_text(SOURCE.format(n=n))
    (csrc / "broken.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(native, "CSRC", csrc)
    kernels = [native.Kernel("k1", ()), native.Kernel("k2", ("-O1",)), native.Kernel("broken", ())]
    lines = []
    native.build_all(kernels, tmp_path / "cache", lines.append)
    assert lines == ["Aerie: building k1, k2, broken for this CPU (once; cached for later starts)..."]
    built = [native.library(k, tmp_path / "cache") for k in kernels]
    assert built[0].is_file() and built[1].is_file() and not built[2].exists()
    assert "-O1" not in built[0].name and built[0].name.startswith("k1-")
    stamps = [p.stat().st_mtime_ns for p in built[:2]]
    lines.clear()
    native.build_all(kernels[:2], tmp_path / "cache", lines.append)   # built already: nothing to say or do
    assert lines == [] and [p.stat().st_mtime_ns for p in built[:2]] == stamps
    with pytest.raises(native.NativeUnavailable, match="compiling broken.cpp failed"):
        native.build(kernels[2], tmp_path / "cache")   # its own build says why
    assert native.build(kernels[0], tmp_path / "cache") and native.loaded("k1")
    native.build_all(kernels[:1], tmp_path / "another", lines.append)   # loaded: another cache needs no copy
    assert lines == [] and not (tmp_path / "another").exists()
