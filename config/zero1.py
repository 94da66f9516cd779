# torchrun --standalone --nproc_per_node=8 train.py config/zero1.py
# GPT-2 124M as in config/gpt2_124m.py, with ZeRO-1: fp32 master/exp_avg/exp_avg_sq sharded 8 ways; full bf16 params and fp32 grads on every GPU.
# Per GPU (Ψ = 124M, GB = 1e9 bytes): 2Ψ bf16 params + 4Ψ fp32 flat_grad + (4 + 12)Ψ/8 fp32 grad shard and optimizer state
# = 0.25 + 0.50 + 0.25 GB (python zero.py estimate --config config/zero1.py --world 8). Sends 1Ψ reduce-scatter + 1Ψ all-gather.
# On a CPU, a small model with 2 gloo ranks:
# torchrun --standalone --nproc_per_node=2 train.py config/zero1.py --device=cpu --dtype=float32 --n_layer=4 --n_head=4 --n_embd=128 --block_size=64 --batch_size=8 --gradient_accumulation_steps=2 --max_iters=100
exec(open('config/gpt2_124m.py').read())  # run from the repository root, like every command here
out_dir = 'out-zero1'
zero_stage = 1
bucket_mb = 25.0  # grads are collected and reduce-scattered in ~25 MB fp32 buckets
