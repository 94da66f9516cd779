"""
What only a GPU can check. Every other test file runs on the CPU with gloo, GPU or not ([Note: the suite's
device] in test_zero.py).

    python -m pytest -q test_gpu.py
"""
import pytest
import torch

from test_zero import assert_same_run, run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="test_gpu.py needs CUDA: no GPU here")

# --- issue 21: the CPU suite on a GPU machine


def test_the_cpu_harness_keeps_its_fsdp2_oracle_on_the_cpu_beside_a_gpu():
    # the spawn that died with SIGSEGV when fully_shard took cuda:0 for both ranks behind gloo
    fsdp2, ddp = run_ranks(2, [dict(kind=k, accum=4) for k in ('fsdp2', 'ddp')])
    for result in (fsdp2, ddp):
        assert not isinstance(result, Exception), result
    assert {t.device.type for t in fsdp2['params'].values()} == {'cpu'}
    assert_same_run(fsdp2, ddp)
