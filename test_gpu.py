"""
What only a GPU can check. Run on a CUDA machine: python -m pytest -q test_gpu.py
"""
import pytest
import torch

from model import GPT, GPTConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="test_gpu.py needs CUDA: run it on a GPU machine")

# --- issue 19: every rank initializes only its own shard, activation checkpointing


def test_counter_based_init_is_the_same_on_cpu_and_cuda():
    """model.py [Note: counter-based init]: the hash is exact integer arithmetic on both devices; Box-Muller runs in
    float64 and is rounded to float32 once, so a value can differ only where CUDA's and the CPU's float64 log or cos
    differ by an ulp right at a float32 rounding boundary (about 1 element in 2^28)."""
    config = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=128)
    cpu = GPT(config)
    with torch.device('cuda'):  # the default device: init_param must draw on the tensor's device, whatever it is
        cuda = GPT(config)
    for (name, a), b in zip(cpu.named_parameters(), cuda.parameters()):
        assert b.is_cuda and torch.equal(a.detach(), b.detach().cpu()), name
    big_cpu, big_cuda = torch.empty(1 << 22), torch.empty(1 << 22, device='cuda')
    for t in (big_cpu, big_cuda):
        cpu.init_param('transformer.h.0.attn.c_attn.weight', t, start=12345)
    diff = big_cpu != big_cuda.cpu()
    assert diff.sum() <= 2, diff.sum()  # 4M elements: 1/64 expected
    torch.testing.assert_close(big_cuda.cpu(), big_cpu, rtol=2**-23, atol=0)  # and then by one float32 ulp


def test_meta_built_stage3_on_cuda_with_checkpointing_trains():
    """A stage-3 engine built on the meta device and materialized on CUDA (shards drawn there) trains a step with
    activation checkpointing: the recomputed blocks are gathered on the GPU."""
    import datetime
    import os
    import torch.distributed as dist
    import fsdp_lite
    import zero
    os.environ.setdefault('MASTER_ADDR', '127.0.0.1')
    os.environ.setdefault('MASTER_PORT', '29731')
    dist.init_process_group('nccl', rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        with torch.device('meta'):
            model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=128))
        cfg = zero.ZeroConfig(stage=3, param_dtype=torch.float32)
        engine = zero.build_engine(model, cfg, units=list(model.transformer.h), device=torch.device('cuda'))
        fsdp_lite.checkpoint_activations(model.transformer.h)
        plain = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=128))
        for name, p in plain.named_parameters():  # world size 1: the unit's shard is the whole param
            b = engine.bucket_of[model.get_parameter(name)]
            torch.testing.assert_close(engine.master_values(b)[b.offset_of[model.get_parameter(name)]:][:p.numel()].cpu(),
                                       p.detach().reshape(-1), rtol=0, atol=0)
        x = torch.randint(128, (2, 32), device='cuda')
        _, loss = engine.module(x, x)
        engine.backward(loss)
        assert torch.isfinite(torch.tensor(engine.step(1e-3)))
    finally:
        dist.destroy_process_group()
