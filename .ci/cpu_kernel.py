"""The CPU kernel (csrc/adamw_cpu.cpp) outside the library, compiled with its flags into a program of .ci/:

    python .ci/cpu_kernel.py check        # the 8-bit encode against the buckets for every fp32 xn in [-1, 1] and every
                                          # NaN, both code maps ([Note: a code from its decade]); exit 1 on a mismatch
    python .ci/cpu_kernel.py time         # ns an element in cache, one thread, every storage-precision mode; with
                                          # AVX-512 VBMI also the 8-bit encode (each map) and decode alone, a value
    python .ci/cpu_kernel.py time -DX=1   # ... with extra compiler flags (to time a variant built under #ifdef X)

check builds in ~5 s and runs in ~5 s on 2 cores; test_kernels.py checks a dense subset through the kernel each run."""
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import kernels  # noqa: E402
import library  # noqa: E402

what, flags = (sys.argv[1] if len(sys.argv) > 1 else ''), sys.argv[2:]
if what not in ('check', 'time'):
    sys.exit(__doc__)
with tempfile.TemporaryDirectory() as tmp:
    tables, buckets = kernels._code_tables('cpu')
    with open(os.path.join(tmp, 'tables.bin'), 'wb') as f:
        f.write(tables.numpy().tobytes() + buckets.numpy().tobytes())
    source = os.path.join(ROOT, '.ci', 'encode_check.cpp' if what == 'check' else 'kernel_ns.cpp')
    binary = os.path.join(tmp, what)
    compiler = library._compiler('cpu')[0]
    subprocess.run([compiler, *library.CPU_FLAGS, '-std=c++17', *flags, '-o', binary, source], check=True)
    env = {**os.environ, 'OMP_NUM_THREADS': '1'} if what == 'time' else None
    sys.exit(subprocess.run([binary, os.path.join(tmp, 'tables.bin')], env=env).returncode)
