"""Aerie's own C++ ops (models/csrc/): compiled once per machine into the user's cache, then loaded.

A kernel is one C++ file of torch ops. It is built with g++ (which torch's compiled graphs need on
a CPU anyway) against the installed torch, with the instruction-set flags its caller names, into
`<cache>/kernels/<name>-<digest>.so`; the digest covers the source, torch's version and the flags,
so a changed kernel, torch or CPU builds anew and never loads a library built for another.
"""

import hashlib
import subprocess
import sys
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"


class NativeUnavailable(RuntimeError):
    """A kernel cannot be built or loaded here; the message says why."""


def digest(source: Path, flags: tuple[str, ...]) -> str:
    """What a built kernel depends on: its source and the headers beside it, torch's version and
    the compiler flags."""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    return hashlib.sha256(source.read_bytes() + headers + torch.__version__.encode() + " ".join(flags).encode()).hexdigest()[:16]


def _compile(source: Path, flags: tuple[str, ...], out: Path) -> None:
    from torch.utils import cpp_extension
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    command = ["g++", "-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", *flags, abi, *includes, str(source),
               "-o", str(out) + ".tmp", *libs, "-lc10", "-ltorch_cpu"]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except FileNotFoundError as e:
        raise NativeUnavailable("no C++ compiler (g++) to build it") from e
    if done.returncode != 0:
        raise NativeUnavailable(f"compiling {source.name} failed: {done.stderr.strip()[-600:]}")
    Path(str(out) + ".tmp").replace(out)


_loaded: set[str] = set()   # kernel names loaded in this process


def widest_vectors(cpu_flags) -> tuple[str, ...]:
    """The compiler flags for this CPU's widest vectors (lanes.h sizes its vectors by them): AVX-512,
    else AVX2 with FMA, else none (SSE)."""
    flags = set(cpu_flags)
    return ("-mavx512f", "-mavx512vl") if "avx512f" in flags else ("-mavx2", "-mfma") if "avx2" in flags else ()


def loaded(name: str) -> bool:
    """Whether this process has loaded the kernel `name` (`build`)."""
    return name in _loaded


def build(name: str, flags: tuple[str, ...], cache_dir: Path) -> bool:
    """Compile models/csrc/<name>.cpp with `flags` once into `cache_dir` and load its ops; -> whether
    this call loaded them (False: this process has them already; a process holds one build of a
    kernel, as torch registers an op namespace once). Raises NativeUnavailable."""
    if not sys.platform.startswith("linux"):
        raise NativeUnavailable("Aerie's C++ kernels are built for Linux only")
    source = CSRC / f"{name}.cpp"
    library = Path(cache_dir) / "kernels" / f"{name}-{digest(source, flags)}.so"
    if name in _loaded:
        return False
    if not library.is_file():
        library.parent.mkdir(parents=True, exist_ok=True)
        _compile(source, flags, library)
    torch.ops.load_library(str(library))
    _loaded.add(name)
    return True
