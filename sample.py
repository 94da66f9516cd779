"""
Sample from a trained model, nanoGPT-style: print num_samples continuations of start. It reads a consolidated
file (python consolidate.py OUT_DIR -o model.pt) or a sharded checkpoint as train.py wrote it: a
ckpt-N directory, or an out_dir (its newest complete checkpoint), from any zero_stage and world size. Tokens are
characters or GPT-2 BPE, as the run's dataset was prepared (its meta.json; a consolidated file carries it).

$ python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=2 --max_new_tokens=200
$ python sample.py --ckpt=model.pt
"""
import argparse
import math
import os
import re

import torch

import checkpoint
import launch
import resume
import consolidate
from model import GPT, GPTConfig


def load_model(path):
    """(GPT in eval mode, info: model_args, iter_num, best_val_loss, config, stage, world_size[, meta])."""
    if os.path.isfile(path):
        try:
            info = torch.load(path, map_location='cpu', weights_only=True)
        except Exception as e:  # not a torch file at all (torch says why in many lines)
            raise ValueError(f"not a file torch.save wrote ({type(e).__name__})") from None
        if not isinstance(info, dict) or 'model' not in info:  # e.g. one rank's shard file of a ckpt-N directory
            raise ValueError("not a consolidated model: give its ckpt-N directory or out_dir, or make one with "
                             "python consolidate.py OUT_DIR -o model.pt")
        state = info.pop('model')
    else:
        state, info = consolidate.full_state_dict(path)
    with torch.device('meta'):  # no init drawn: the state overwrites every param (GPT-2 124M: ~3.5 s of draws here)
        model = GPT(GPTConfig(**info['model_args']))
    model.to_empty(device='cpu')  # beside the state, whatever the default device; main() moves it to --device
    model.tie_weights()  # to_empty made the tied Parameter two
    model.load_state_dict(state, strict=True)
    return model.eval(), info


def tokenizer(info):
    """(encode, decode) for the run's dataset. Ids past the dataset's vocabulary are the padding that rounds
    it up to a multiple of 64 (84 characters -> 128, GPT-2's 50257 -> 50304): they decode to nothing."""
    meta = info.get('meta') or checkpoint.dataset_meta(info['config']['dataset'])  # the manifest's, or the dataset's
    if not meta and info['model_args']['vocab_size'] != 50304:  # not GPT-2's: decoding it as GPT-2's fails or lies
        raise SystemExit(f"the tokenizer of this {info['model_args']['vocab_size']}-token model is unknown: "
                         f"data/{info['config']['dataset']}/meta.json is not here; copy it from the machine that trained it")
    if meta.get('tokenizer') == 'char':
        chars = meta['chars']
        stoi = {c: i for i, c in enumerate(chars)}

        def encode(text):
            unknown = sorted(set(text) - set(stoi))
            if unknown:
                raise SystemExit(f"the start text has characters this model never saw: {''.join(unknown)!r}")
            return [stoi[c] for c in text]
        return encode, lambda ids: ''.join(chars[i] for i in ids if i < len(chars))
    from data.shakespeare.prepare import gpt2_encoding
    try:  # GPT-2's BPE files from the dataset's directory (prepare.py writes them there) or data/.cache/
        enc = gpt2_encoding(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', info['config']['dataset']))
    except RuntimeError as e:
        raise SystemExit(f"cannot decode GPT-2 tokens: {e}")
    return (lambda text: enc.encode(text, allowed_special={'<|endoftext|>'}),
            lambda ids: enc.decode([i for i in ids if i < enc.n_vocab]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--ckpt', default=None, help="a consolidated .pt file or a checkpoint directory (ckpt-N)")
    parser.add_argument('--out_dir', default='out-shakespeare-char', help="without --ckpt: its newest checkpoint")
    parser.add_argument('--start', default='\n', help="prompt text, or FILE:path to read it from a file")
    parser.add_argument('--num_samples', type=int, default=3)
    parser.add_argument('--max_new_tokens', type=int, default=300)
    parser.add_argument('--temperature', type=float, default=0.8, help='< 1 sharper, > 1 more random')
    parser.add_argument('--top_k', type=int, default=200, help='sample only from the k most likely tokens')
    parser.add_argument('--seed', type=int, default=1337)
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    args = parser.parse_args(argv)
    wrong = [f"--{k}={getattr(args, k)}: use at least 1" for k in ('num_samples', 'max_new_tokens', 'top_k') if getattr(args, k) < 1]
    wrong += [f"--temperature={args.temperature}: use a finite value > 0 (--top_k=1 decodes greedily)"] * (
        not 0 < args.temperature < math.inf)  # (nan too; a tiny one is fine: model.generate shifts the logits first)
    wrong += [f"--seed={args.seed}: use an integer from -2**63 to 2**64 - 1"] * (not -2**63 <= args.seed < 2**64)  # torch's
    wrong += [f"--device={args.device}: use cpu or cuda (cuda:N)"] * (not re.fullmatch(r'cpu|cuda(:\d+)?', args.device))
    wrong += ["--start is empty: give at least one character (the default is a newline)"] * (args.start in ('', 'FILE:'))
    absent = re.fullmatch(r'cuda(:\d+)?', args.device) and launch.absent_gpu(args.device)
    wrong += [f"--device={args.device}: {absent}"] * bool(absent)
    if wrong:
        parser.error(wrong[0])
    path = args.ckpt or args.out_dir
    try:
        model, info = load_model(path)
    except resume.Damaged as e:
        raise SystemExit(f"cannot sample from {path}: {e}; name an older ckpt-* directory")
    except (ValueError, FileNotFoundError) as e:  # nothing there yet: say how to make one
        none = not os.path.exists(path) or (os.path.isdir(path) and resume.latest(path) is None
                                            and not os.path.exists(os.path.join(path, 'manifest.json')))
        raise SystemExit(f"cannot sample from {path}: {e}" + " (train first: train.py saves a checkpoint at each eval "
                         "that improves)" * none)
    model.to(args.device)
    print(f"{path}: iteration {info['iter_num']}, val loss {info['best_val_loss']:.4f}, trained with "
          f"zero_stage={info['stage']} on {info['world_size']} rank(s); sampling on {args.device}")
    encode, decode = tokenizer(info)
    start = args.start
    if start.startswith('FILE:'):
        try:
            with open(start[5:], encoding='utf-8') as f:
                start = f.read()
        except OSError as e:
            parser.error(f"--start={args.start}: {e.strerror}")
    torch.manual_seed(args.seed)
    x = torch.tensor(encode(start), dtype=torch.long, device=args.device)[None, ...]
    for _ in range(args.num_samples):
        y = model.generate(x, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k)
        print(decode(y[0].tolist()))
        print('---------------')


if __name__ == '__main__':
    main()
