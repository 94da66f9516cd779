# torchrun --standalone --nproc_per_node=8 train.py config/zero2.py
# GPT-2 124M as in config/gpt2_124m.py, with ZeRO-2: grads sharded too, reduce-scattered bucket by bucket during each micro-step's backward.
# Per GPU: 2Ψ bf16 params + 16Ψ/8 = 0.25 + 0.25 GB (+ one bucket_mb grad buffer in flight). Sends 1Ψ reduce-scatter per
# micro-step + 1Ψ all-gather per step (python zero.py estimate --config config/zero2.py --world 8).
# On a CPU, a small model with 2 gloo ranks:
# torchrun --standalone --nproc_per_node=2 train.py config/zero2.py --device=cpu --dtype=float32 --n_layer=4 --n_head=4 --n_embd=128 --block_size=64 --batch_size=8 --gradient_accumulation_steps=2 --max_iters=100
exec(open('config/gpt2_124m.py').read())  # run from the repository root, like every command here
out_dir = 'out-zero2'
zero_stage = 2
bucket_mb = 25.0
