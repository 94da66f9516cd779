# torchrun --standalone --nproc_per_node=8 train.py config/gpt2_124m.py
# GPT-2 124M (12 layers, 12 heads, 768 wide) on 8 GPUs with torch DDP, the baseline of the zero*.py
# configs (they start from this file). ~0.5M tokens per step:
# 12 batch * 1024 tokens * 40 micro-steps (5 per GPU * 8 GPUs) = 491,520.
# Data: the Shakespeare plays by default (1.4M tokens: a model this size memorizes them, so watch val
# loss); for real pretraining prepare your own corpus: python data/shakespeare/prepare.py --input=... --out_dir=data/NAME
# On a CPU, a small model with 2 gloo ranks:
# torchrun --standalone --nproc_per_node=2 train.py config/gpt2_124m.py --device=cpu --dtype=float32 --n_layer=4 --n_head=4 --n_embd=128 --block_size=64 --batch_size=8 --gradient_accumulation_steps=2 --max_iters=100
out_dir = 'out-gpt2-124m'
dataset = 'shakespeare'
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 5 * 8
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False
learning_rate = 6e-4
max_iters = 5000
lr_decay_iters = 5000
warmup_iters = 200
min_lr = 6e-5
weight_decay = 1e-1
eval_interval = 250
eval_iters = 100
log_interval = 10
dtype = 'bfloat16'
compile = False
zero_stage = 0
