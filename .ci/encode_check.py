"""The CPU kernel's 8-bit encode against the buckets for every fp32 xn in [-1, 1] and every NaN, both code maps
(csrc/adamw_cpu.cpp, [Note: a code from its decade]): `python .ci/encode_check.py`, ~10 s to build, ~5 s on 2 cores.
Exits 1 on any mismatch. test_kernels.py checks a dense subset through the kernel on every run."""
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import kernels  # noqa: E402
import library  # noqa: E402

with tempfile.TemporaryDirectory() as tmp:
    tables, buckets = kernels._code_tables('cpu')
    with open(os.path.join(tmp, 'tables.bin'), 'wb') as f:
        f.write(tables.numpy().tobytes() + buckets.numpy().tobytes())
    binary = os.path.join(tmp, 'encode_check')
    subprocess.run([library._compiler('cpu')[0], *library.CPU_FLAGS, '-std=c++17', '-o', binary,
                    os.path.join(ROOT, '.ci', 'encode_check.cpp')], check=True)
    sys.exit(subprocess.run([binary, os.path.join(tmp, 'tables.bin')]).returncode)
