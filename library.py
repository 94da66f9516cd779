"""
How the fused AdamW step's C++ and CUDA sources (csrc/) become a function Python can call: one compiler call into a
plain shared library, cached on disk under a hash of everything that changes the binary, built once under a file lock
when many ranks start together, loaded with ctypes and called on torch's current stream. kernels.py says what the step
computes, picks the library (kernels.resolve_impl) and calls it; nothing here knows about precision modes or ZeRO.

    python -m pytest -q test_kernels.py -k "build or library or arch or nvcc"
"""
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

# ----------------------------------------------------------------------------
# the sources

# The sources are in csrc/: adamw_common.h is compiled twice, by g++ into the CPU library (adamw_cpu.cpp) and by nvcc
# into the CUDA one (adamw.cu; HD = __host__ __device__), so the two share every rounding and the update itself. The
# CPU loop and the CUDA kernels differ only in how they walk memory.
CSRC = Path(__file__).resolve().parent / "csrc"


def _source(name):
    """A file of csrc/ with its #include "adamw_common.h" inlined: one self-contained text per library, which is
    what the build compiles and hashes (test_kernels.py also compiles the CUDA text for the host)."""
    return (CSRC / name).read_text().replace('#include "adamw_common.h"', (CSRC / "adamw_common.h").read_text())


CPU_SOURCE = _source("adamw_cpu.cpp")
CUDA_SOURCE = _source("adamw.cu")


class AdamWArgs(ctypes.Structure):
    """The C struct AdamWArgs, field for field; each library's adamw_args_size() is checked against it at load."""
    _fields_ = [(name, ctypes.c_void_p) for name in ("master", "param", "grad", "exp_avg", "exp_avg_sq",
                                                     "exp_avg_absmax", "exp_avg_sq_absmax", "tables", "buckets",
                                                     "found_inf")] + \
               [(name, ctypes.c_int64) for name in ("n", "decay_numel", "index_offset")] + \
               [(name, ctypes.c_int32) for name in ("grad_kind", "state_kind", "weights_kind")] + \
               [(name, ctypes.c_uint32) for name in ("seed", "step")] + \
               [(name, ctypes.c_float) for name in ("grad_scale", "one_minus_beta1", "beta2", "one_minus_beta2", "eps",
                                                    "decay", "step_size", "bias_correction2_sqrt")]

# ----------------------------------------------------------------------------
# build: plain shared libraries, cached on disk, loaded with ctypes

# [Note: plain shared libraries]
# The sources include no torch headers, so a build is one compiler call: measured on 2 cores, 2.6 s for the CPU
# library (g++ 12, all 42 instances) and 8.8 s for the CUDA one (nvcc 13, sm_90, 26 Nov), where
# torch.utils.cpp_extension (torch's headers, ninja) took 25-40 s for the CPU one alone. Python fills the args struct from tensors and
# calls an extern "C" entry point through ctypes. The CUDA library links the *shared* cudart, so it uses the
# libcudart that torch has already loaded, and launches on torch's current stream. The file name carries a hash of
# everything that changes the binary: source, flags, compiler and version, the CPU's extensions (-march=native code
# only runs on CPUs like the one that built it) or the GPU archs. Many ranks starting at once: one takes a file lock
# and builds into a temporary file that it renames into place; the others wait on the lock, then find it built.

CPU_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]  # -fno-math-errno: sqrt vectorizes
CUDA_FLAGS = ["-O3", "--fmad=false"]  # no fma contraction beyond the explicit ones, as in the CPU build
SHARED_FLAGS = {"cpu": ["-std=c++17", "-shared", "-fPIC"],
                "cuda": ["-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-cudart", "shared"]}  # torch's cudart


def _compiler(impl):
    """(path, version) of the compiler for impl; RuntimeError with a one-line reason if there is none."""
    if impl == "cpu":
        name = os.environ.get("CXX", "c++")
        path = shutil.which(name)
        if path is None:
            raise RuntimeError(f"no C++ compiler ({name}) on PATH")
    else:
        cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
        path = shutil.which("nvcc") or shutil.which(os.path.join(cuda_home, "bin", "nvcc"))
        if path is None:
            raise RuntimeError("no CUDA toolkit: nvcc is not on PATH nor in $CUDA_HOME/bin")
    return path, _run(path, "--version")


@functools.lru_cache(maxsize=None)
def _run(*command):
    return subprocess.run(command, capture_output=True, text=True).stdout.strip()


# TORCH_CUDA_ARCH_LIST's names, expanded as torch's extension builder expands them (torch.utils.cpp_extension)
NAMED_ARCHS = {"Kepler+Tesla": "3.7", "Kepler": "3.5+PTX", "Maxwell+Tegra": "5.3", "Maxwell": "5.0 5.2+PTX",
               "Pascal": "6.0 6.1+PTX", "Volta+Tegra": "7.2", "Volta": "7.0+PTX", "Turing": "7.5+PTX",
               "Ampere+Tegra": "8.7", "Ampere": "8.0 8.6+PTX", "Ada": "8.9+PTX", "Hopper": "9.0+PTX",
               "Blackwell+Tegra": "11.0", "Blackwell": "10.0 10.3 12.0 12.1+PTX"}


def _cuda_arch_flags():
    """-gencode flags for TORCH_CUDA_ARCH_LIST (e.g. "8.0;9.0+PTX"), and for this GPU (sm_90 on H100/H200) if nothing in
    the list runs on it: a list set in a container for other GPUs would build a library with no kernel this one can
    run, found only at the first step."""
    entries = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(";", " ").replace(",", " ").split()
    archs = [arch for e in entries for arch in NAMED_ARCHS.get(e, "" if e == "native" else e).split()]  # native: none
    for arch in archs:  # a RuntimeError: the build falls back, with this line as its warning
        if not re.fullmatch(r"\d+\.\d+a?(\+PTX)?", arch):
            raise RuntimeError(f"TORCH_CUDA_ARCH_LIST has {arch!r}, not a CUDA arch: write e.g. 9.0, 9.0a, 8.6+PTX, "
                               "a name such as Hopper, or native")
    if torch.cuda.is_available() and not any(_runs_on(arch, torch.cuda.get_device_capability()) for arch in archs):
        archs.append("%d.%d" % torch.cuda.get_device_capability())
    if not archs:
        raise RuntimeError("no GPU to build for: set TORCH_CUDA_ARCH_LIST, e.g. 9.0")
    flags = []
    for arch in archs:
        sm = arch.removesuffix("+PTX").replace(".", "")  # "9.0" -> "90", "9.0a" -> "90a"
        flags.append(f"-gencode=arch=compute_{sm},code=sm_{sm}")
        if arch.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{sm},code=compute_{sm}")
    return flags


def _runs_on(arch, capability):
    """Whether code built for arch ("8.0", "9.0a", "8.6+PTX") runs on a GPU of capability (major, minor): a binary on
    its own major at an equal or higher minor, an arch-specific one ("a") on its own GPU only, PTX on any newer GPU."""
    a = arch.removesuffix("+PTX")
    major, minor = (int(x) for x in a.removesuffix("a").split("."))
    if a.endswith("a"):
        return (major, minor) == tuple(capability)
    return (major, minor) <= tuple(capability) and (arch.endswith("+PTX") or major == capability[0])


def _command(impl):
    """The compiler call, less its output and input files."""
    compiler, _ = _compiler(impl)
    if impl == "cpu":
        return [compiler, *CPU_FLAGS, *SHARED_FLAGS["cpu"]]
    return [compiler, *CUDA_FLAGS, *_cuda_arch_flags(), *SHARED_FLAGS["cuda"]]


def cache_path(impl, source=None):
    """Where the library for impl ('cpu' or 'cuda') is cached: ~/.cache/nanozero/ or $NANOZERO_CACHE. If it does not
    exist yet, the first adamw_step builds it (seconds: [Note: plain shared libraries]), so a caller can say so first.
    RuntimeError with the reason if impl cannot be built here (no compiler; for 'cuda' no GPU and no arch list).
    source: another text than csrc/'s (bench.py kernels --against)."""
    source = source or (CPU_SOURCE if impl == "cpu" else CUDA_SOURCE)
    # the CPU: every ISA macro -march=native enables here (two CPUs of one AVX-512 level can still differ)
    isa = _run(_compiler("cpu")[0], "-march=native", "-dM", "-E", "-x", "c++", "/dev/null") if impl == "cpu" else ""
    key = "\0".join([source, *_command(impl), _compiler(impl)[1], isa])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("NANOZERO_CACHE") or Path.home() / ".cache" / "nanozero")
    return cache / f"adamw_{impl}_{digest}.so"


def compile_library(source, command, path):
    """Compile source with command (the compiler and its flags) into the shared library path, once: [Note: plain
    shared libraries]. RuntimeError with the compiler's first error line if it fails."""
    if path.exists():
        return  # built: no lock needed (a read-only cache works too)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when a killed process exits
        if path.exists():
            return  # another process built it while we waited
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            src, out = Path(tmp) / ("adamw.cu" if "nvcc" in Path(command[0]).name else "adamw.cpp"), Path(tmp) / "adamw.so"
            src.write_text(source)
            # nvcc adds NVCC_APPEND_FLAGS / NVCC_PREPEND_FLAGS to every call (e.g. --use_fast_math, set for another
            # project): a binary the cache name does not describe, its sqrt and divides no longer IEEE. Left out.
            env = {k: v for k, v in os.environ.items() if k not in ("NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS")}
            result = subprocess.run([*command, "-o", str(out), str(src)], capture_output=True, text=True, env=env)
            if result.returncode != 0:
                lines = (result.stderr + result.stdout).splitlines() or [f"exit code {result.returncode}"]
                raise RuntimeError(next((line for line in lines if "error" in line), lines[0]).strip()[:300])
            os.replace(out, path)


class Library:
    """A built kernel library, loaded with ctypes: call('adamw_step', ...) runs one AdamW step, 'cast_bf16' a cast."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.adamw_args_size.restype = ctypes.c_size_t
        size = self.lib.adamw_args_size()
        if size != ctypes.sizeof(AdamWArgs):
            raise RuntimeError(f"{path}: the C AdamWArgs is {size} bytes but library.AdamWArgs is "
                               f"{ctypes.sizeof(AdamWArgs)}: the two must list the same fields")

    def call(self, name, device, *args):
        """The library's entry point name(*args, stream): on a GPU, on torch's current stream of device."""
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            stream = torch.cuda.current_stream().cuda_stream if device.type == "cuda" else None
            error = getattr(self.lib, name)(*args, ctypes.c_void_p(stream))
        if error:  # only the CUDA library returns errors: a cudaError_t
            self.lib.adamw_error_string.restype = ctypes.c_char_p
            raise RuntimeError(f"nanozero {name} launch failed: {self.lib.adamw_error_string(error).decode()}")


def same_cuda_as_torch(nvcc_version):
    """The CUDA library links nvcc's shared cudart (libcudart.so.13 for CUDA 13): beside a torch of another CUDA major
    it would load a second runtime, one its driver may not run, found only at the first step. RuntimeError instead."""
    ours, torchs = re.search(r"release (\d+)\.", nvcc_version), torch.version.cuda
    if ours and torchs and ours.group(1) != torchs.split(".")[0]:
        raise RuntimeError(f"nvcc is CUDA {ours.group(1)} and torch runs CUDA {torchs}: put CUDA {torchs.split('.')[0]}'s "
                           "nvcc first on PATH (or in $CUDA_HOME/bin)")


def build(impl, source=None):
    """Build (or find in the cache) and load one library; RuntimeError with a one-line reason.
    Building the CUDA one needs nvcc, not a GPU (set TORCH_CUDA_ARCH_LIST, e.g. "9.0")."""
    source = source or (CPU_SOURCE if impl == "cpu" else CUDA_SOURCE)
    try:
        if impl == "cuda":
            same_cuda_as_torch(_compiler("cuda")[1])
        path = cache_path(impl, source)
        compile_library(source, _command(impl), path)
        return Library(path)
    except (RuntimeError, OSError) as e:
        raise RuntimeError(f"{impl} build failed: {e}") from e
