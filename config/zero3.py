# torchrun --standalone --nproc_per_node=8 train.py config/zero3.py
# GPT-2 124M as in config/gpt2_124m.py, with ZeRO-3: params sharded too (fsdp_lite.py): each unit of 3 blocks is
# all-gathered just before its forward and backward.
# Per GPU: 16Ψ/8 = 0.25 GB (fp32 master + grad shard + moments; no bf16 shard: each all-gather rounds the master),
# + prefetch+1 units and the embedding unit unsharded. Sends ~2.3Ψ per micro-step (3Ψ less the root, gathered once a
# step, and the last unit, kept into backward: README, "The physics"). Built on the meta device: no rank ever holds
# the whole model. --compile=True compiles each block (the gathering hooks stay outside).
# On a CPU, a small model with 2 gloo ranks:
# torchrun --standalone --nproc_per_node=2 train.py config/zero3.py --device=cpu --dtype=float32 --n_layer=4 --n_head=4 --n_embd=128 --block_size=64 --batch_size=8 --gradient_accumulation_steps=2 --max_iters=100
exec(open('config/gpt2_124m.py').read())  # run from the repository root, like every command here
out_dir = 'out-zero3'
zero_stage = 3
prefetch = 1  # one unit's all-gather in flight ahead of compute
reshard_after_forward = True  # False: no backward re-gather (2Ψ), units stay gathered from forward to backward
# 3 blocks gathered as one unit (fsdp_lite [Note: blocks per unit]): 7 all-gathers a micro-step instead of 23, for
# 6 of the 12 blocks unsharded at once. On one H200, compiled: 1.08x DDP's step against 1.34x at 1 (bench.py zero,
# assets/gpu_h200.md), max_memory_allocated still <= stage 2's (test_gpu.py). 1: a unit a block, as FSDP2.
blocks_per_unit = 3
