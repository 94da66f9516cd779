# torchrun --standalone --nproc_per_node=2 train.py config/shakespeare_char.py
# README command (1): a small GPT (4 layers, 128 wide, 0.8M params) on the 42 Shakespeare plays, one token per
# character (84 of them), on a laptop CPU with 2 gloo ranks and ZeRO-2. Val loss 4.84 -> 1.82 (about 2 minutes on 2 cores: the README); then
# python sample.py --out_dir=out-shakespeare-char prints text that reads like a play.
out_dir = 'out-shakespeare-char'
eval_interval = 100
eval_iters = 20  # batches per split, shared by the ranks
log_interval = 50
dataset = 'shakespeare_char'
gradient_accumulation_steps = 2  # 1 micro-step per rank at 2 ranks
batch_size = 16
block_size = 64  # 16 * 64 = 1,024 tokens per rank per step
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
learning_rate = 2e-3
max_iters = 1000
lr_decay_iters = 1000
warmup_iters = 50
min_lr = 2e-4
device = 'cpu'
dtype = 'float32'  # most CPUs have no fast bf16 matmul; GPU configs use bfloat16
zero_stage = 2
bucket_mb = 4.0
