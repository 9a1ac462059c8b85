"""Aerie's own C++ ops (models/csrc/): compiled once per machine into the user's cache, then loaded.

A kernel is one C++ file of torch ops. It is built with g++ (which torch's compiled graphs need on
a CPU anyway) against the installed torch, with the instruction-set flags its caller names, into
`<cache>/kernels/<name>-<digest>.so`; the digest covers the source, torch's version and the flags,
so a changed kernel, torch or CPU builds anew and never loads a library built for another.
"""

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"


class NativeUnavailable(RuntimeError):
    """A kernel cannot be built or loaded here; the message says why."""


@dataclass(frozen=True)
class Kernel:
    """One C++ file of models/csrc and the compiler flags its caller builds it with."""
    name: str
    flags: tuple[str, ...]

    def source_digest(self) -> str:
        """What its build depends on (`digest`): part of its library's name and of the cache keys
        of what was timed with it."""
        return digest(CSRC / f"{self.name}.cpp", self.flags)


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


def library(kernel: Kernel, cache_dir: Path) -> Path:
    """Where `kernel` is built for this source, torch and flags."""
    return Path(cache_dir) / "kernels" / f"{kernel.name}-{kernel.source_digest()}.so"


def build_all(kernels: Iterable[Kernel], cache_dir: Path, report=print) -> None:
    """Compile those of `kernels` not built yet into `cache_dir`, side by side: g++ uses one core,
    so on two a first start's three kernels took 22 s instead of 36 s one after another (2-core
    Zen 4). `build` then loads them; one that failed here is compiled again by
    its `build`, which raises why. A kernel this process has loaded already is not built again."""
    missing = [k for k in kernels if k.name not in _loaded and not library(k, cache_dir).is_file()]
    if not missing or not sys.platform.startswith("linux"):
        return
    report(f"Aerie: building {', '.join(k.name for k in missing)} for this CPU (once; cached for later starts)...")

    def compile_one(kernel: Kernel) -> None:
        out = library(kernel, cache_dir)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            _compile(CSRC / f"{kernel.name}.cpp", kernel.flags, out)
        except NativeUnavailable:
            pass   # its build says why
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(compile_one, missing))


def build(kernel: Kernel, cache_dir: Path) -> bool:
    """Compile `kernel` once into `cache_dir` and load its ops; -> whether this call loaded them
    (False: this process has them already; a process holds one build of a kernel, as torch
    registers an op namespace once). Raises NativeUnavailable."""
    if not sys.platform.startswith("linux"):
        raise NativeUnavailable("Aerie's C++ kernels are built for Linux only")
    if kernel.name in _loaded:
        return False
    built = library(kernel, cache_dir)
    if not built.is_file():
        built.parent.mkdir(parents=True, exist_ok=True)
        _compile(CSRC / f"{kernel.name}.cpp", kernel.flags, built)
    torch.ops.load_library(str(built))
    _loaded.add(kernel.name)
    return True
