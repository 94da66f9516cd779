"""
What only a GPU can check: the real CUDA kernel, compiled with nvcc and run on the device.

    python -m pytest -q test_gpu.py
"""
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="test_gpu.py needs CUDA: run it on a GPU machine")

# --- issue 18: 8-bit optimizer state at memory speed
# The warp-per-block 8-bit path on the device: bit for bit the CPU kernel (the host-emulated CUDA test checks the
# same source on the host, but not the device's arithmetic, its shuffles, its vector loads or its launch), on shapes
# with a partly used last CUDA block (32 quantization blocks each) and on unaligned views (the strided path).

import kernels  # noqa: E402
import test_kernels  # noqa: E402


@pytest.mark.parametrize("weights", ["fp32+bf16param", "remainder", "none-stochastic", "fp32"])
@pytest.mark.parametrize("blocks", [1, 33, 4096 + 7])
def test_cuda_8bit_path_equals_the_cpu_kernel_bit_for_bit(weights, blocks):
    n = 256 * blocks
    cpu = test_kernels.Shard(n, weights, "uint8")
    gpu = cpu.to("cuda")
    gen = torch.Generator().manual_seed(5)
    for step in (1, 2, 3):
        grad = test_kernels.spiky_grad(n, gen)
        cpu.step("cpu", grad, weight_decay=0.1, decay_numel=n // 3, step=step, grad_scale=0.37, index_offset=11)
        gpu.step("cuda", grad.cuda(), weight_decay=0.1, decay_numel=n // 3, step=step, grad_scale=0.37, index_offset=11)
        for a, b in zip(cpu.tensors(), gpu.tensors()):
            assert test_kernels.same_bits(a, b)


def test_cuda_8bit_path_in_unaligned_views_equals_the_cpu_kernel():
    n = 256 * 40
    cpu = test_kernels.Shard(n, "remainder", "uint8")
    gpu = cpu.to("cuda")
    buffers = {}
    for name in ("exp_avg", "exp_avg_sq", "param"):
        t = getattr(gpu, name)
        buffers[name] = torch.zeros(n + 1, dtype=t.dtype, device="cuda")
        buffers[name][1:] = t
        setattr(gpu, name, buffers[name][1:])  # 1 element in: the strided path
    grad = test_kernels.spiky_grad(n, torch.Generator().manual_seed(6))
    cpu.step("cpu", grad, weight_decay=0.1, decay_numel=n, step=1)
    gpu.step("cuda", grad.cuda(), weight_decay=0.1, decay_numel=n, step=1)
    for a, b in zip(cpu.tensors(), gpu.tensors()):
        assert test_kernels.same_bits(a, b)


def test_bench_modes_prints_a_finite_fraction_of_copy_bandwidth_for_every_mode():
    import bench
    out = subprocess.run([sys.executable, "bench.py", "kernels", "--device", "cuda", "--sizes", "1M", "--modes"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.strip().startswith("1,048,576")]
    assert [row[12:43].strip() for row in rows] == [mode[0] for mode in bench.PRECISION_MODES]
    of_copy = [float(row.split()[-1]) for row in rows]
    assert all(0.0 < f < 2.0 for f in of_copy), of_copy  # a GPU copy moves each byte once: no mode can beat it by 2x
