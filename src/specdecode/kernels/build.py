"""Build our C++ kernels on first use with the machine's g++, once per extension, CPU and torch version.

`-march=native` lets each build use what this CPU has (AVX2, AVX-512 VNNI/BF16, AMX); the sources pick
their code path with the compiler's feature macros. `-fopenmp` makes `at::parallel_for` (inlined from
ATen's headers into the extension) actually run on torch's threads; without it, it runs on one.
Where a build fails (no compiler, no ninja, an old assembler), the caller gets None and a warning: for the CPU
library (w4a8 + gguf-int8 + decode ops + layer) that means w4a8's slow pure-torch reference, a GGUF file's blocks
dequantized and the decoder's PyTorch ops with padding (still lossless, slower); int4-amx is its own extension.
The extensions link no OpenMP runtime of their own: they use the one torch's wheel loads.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from specdecode.cpu import cpu_info
from specdecode.paths import cache_dir

FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")  # no fused multiply-adds: see the sources
KERNELS = Path(__file__).parent
# one library: layer.cpp calls into the others (cpu_ops.h) and binds them all
CPU_SOURCES = (KERNELS / "layer.cpp", KERNELS / "w4a8.cpp", KERNELS / "gguf_int8.cpp", KERNELS / "decode_ops.cpp")
CPU_HEADERS = (KERNELS / "cpu_ops.h", KERNELS / "simd.h", KERNELS / "int8_act.h")


@cache
def cpu_extension(isa_flags: tuple[str, ...] = ()) -> ModuleType | None:
    """Our CPU kernels (w4a8, gguf-int8, the decode ops, the one-call layers) as one extension, or None with a warning.
    isa_flags: extra compiler flags, e.g. ("-mno-avx512f",) builds the AVX2 paths on an AVX-512 CPU (tests)."""
    return build("cpu", CPU_SOURCES, isa_flags, CPU_HEADERS, "w4a8 then runs its slow pure-torch reference, a GGUF "
                 "file's blocks are dequantized and the decoder runs PyTorch's ops, padded in bit-exact mode")


def build(name: str, sources: Sequence[Path], isa_flags: tuple[str, ...] = (), headers: Sequence[Path] = (),
          without: str = "") -> ModuleType | None:
    """`sources` compiled into one extension (into `<cache dir>/kernels/`), or None with a warning that says what
    runs `without` it. Rebuilt when a source or header, this CPU's flags, the compiler flags or torch change."""
    from torch.utils import cpp_extension

    code = b"".join(path.read_bytes() for path in (*sources, *headers))
    key = hashlib.sha256(code + " ".join(sorted(cpu_info()[1]) + list(FLAGS + isa_flags)).encode()
                         + torch.__version__.encode()).hexdigest()[:16]
    build_dir = cache_dir() / "kernels" / f"{name}-{key}"
    module = f"specdecode_{name}_{key}"
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with build_lock(build_dir, name):
            if not (build_dir / f"{module}.so").exists():
                print(f"specdecode: building the {name} kernels for this CPU (once, about a minute) in "
                      f"{build_dir}", file=sys.stderr, flush=True)
            _put_ninja_on_path()
            return cpp_extension.load(name=module, sources=[str(s) for s in sources],
                                      build_directory=str(build_dir), verbose=False, extra_cflags=[*FLAGS, *isa_flags])
    except Exception as exc:  # noqa: BLE001  no compiler, no ninja, an old assembler: fall back, loudly
        warnings.warn(f"the {name} C++ kernels could not be built in {build_dir} ({without}). The build said: "
                      f"...{str(exc)[-1500:]}", stacklevel=2)
        return None


@contextmanager
def build_lock(build_dir: Path, name: str) -> Iterator[None]:
    """Hold an exclusive flock on `build_dir`/build.flock (holder's pid inside) while torch builds or loads there.

    The OS drops a flock when its holder dies, so a killed build never blocks a later one; a live one is waited
    for with a message. torch's own `lock` file, which a killed build leaves behind and torch waits on forever, is
    stale whenever we hold ours, and is removed."""
    with open(build_dir / "build.flock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "a process"
            print(f"specdecode: waiting for {holder} to finish building the {name} kernels in {build_dir}",
                  file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.truncate(0)
            f.write(f"pid {os.getpid()}")
            f.flush()
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_for_cpu(needs: set[str], make: Callable[[], ModuleType | None]) -> ModuleType | None:
    """`make()`'s extension where this CPU has the `needs` flags (/proc/cpuinfo names) and the build's own
    `available()` agrees (e.g. the OS grants AMX); else None, without building where the flags are missing."""
    from specdecode.cpu import cpu_info

    if not needs <= set(cpu_info()[1]):
        return None
    ext = make()
    return ext if ext is not None and ext.available() else None


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the `ninja` wheel we depend on puts it in the venv's bin, which is only on
    PATH in an activated venv."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
