"""
Sample from a trained model, nanoGPT-style: reads out_dir/ckpt.pt (the full fp32 model that train.py
saves from any zero_stage) and prints num_samples continuations of start.

$ python sample.py --out_dir=out-shakespeare-cpu --start="ROMEO:" --num_samples=2 --max_new_tokens=200
"""
import argparse
import os

import torch

from data.shakespeare.prepare import gpt2_encoding
from model import GPT, GPTConfig

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument('--out_dir', default='out-shakespeare-cpu')
parser.add_argument('--start', default='\n', help="prompt text, or FILE:path to read it from a file")
parser.add_argument('--num_samples', type=int, default=3)
parser.add_argument('--max_new_tokens', type=int, default=300)
parser.add_argument('--temperature', type=float, default=0.8, help='< 1 sharper, > 1 more random')
parser.add_argument('--top_k', type=int, default=200, help='sample only from the k most likely tokens')
parser.add_argument('--seed', type=int, default=1337)
parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
args = parser.parse_args()

torch.manual_seed(args.seed)
ckpt_path = os.path.join(args.out_dir, 'ckpt.pt')
if not os.path.exists(ckpt_path):
    raise SystemExit(f"no checkpoint at {ckpt_path}: train first (train.py saves one at each eval that improves)")
checkpoint = torch.load(ckpt_path, map_location=args.device, weights_only=False)
model = GPT(GPTConfig(**checkpoint['model_args']))
model.load_state_dict(checkpoint['model'])
model.eval().to(args.device)
print(f"{ckpt_path}: iter {checkpoint['iter_num']}, val loss {checkpoint['best_val_loss']:.4f}, "
      f"trained with zero_stage={checkpoint['zero_stage']} on {checkpoint['world_size']} ranks")

enc = gpt2_encoding()
start = args.start
if start.startswith('FILE:'):
    with open(start[5:], encoding='utf-8') as f:
        start = f.read()
x = torch.tensor(enc.encode(start, allowed_special={'<|endoftext|>'}), dtype=torch.long, device=args.device)[None, ...]
for _ in range(args.num_samples):
    y = model.generate(x, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k)
    print(enc.decode([t for t in y[0].tolist() if t < enc.n_vocab]))  # ids >= 50257 are vocab padding
    print('---------------')
