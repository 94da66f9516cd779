# torchrun --standalone --nproc_per_node=2 train.py config/shakespeare_cpu.py
# A small GPT (4 layers, 128 wide, 7.2M params of which 6.4M are the tied GPT-2 embedding) on the 42
# Shakespeare plays, on a laptop CPU with 2 gloo ranks and ZeRO-2: a few minutes, val loss 10.8 -> < 6.
out_dir = 'out-shakespeare-cpu'
eval_interval = 50
eval_iters = 10
log_interval = 10
dataset = 'shakespeare'
gradient_accumulation_steps = 2  # 1 micro-step per rank at 2 ranks
batch_size = 8
block_size = 64  # 8 * 64 = 512 tokens per rank per step; logits (512, 50304) dominate the time
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
learning_rate = 2e-3
max_iters = 250
lr_decay_iters = 250
warmup_iters = 20
min_lr = 2e-4
device = 'cpu'
dtype = 'float32'  # most CPUs have no fast bf16 matmul; GPU configs use bfloat16
zero_stage = 2
bucket_mb = 4.0
