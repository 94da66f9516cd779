"""
Character-level Shakespeare, as in nanoGPT's quick start: every character of the 42 plays is a token (84
distinct ones), train.bin / val.bin as uint16 (first 90% / last 10%) and meta.json with the alphabet, which
train.py reads for the vocab size and sample.py for decoding. With a vocab of 84 instead of GPT-2's 50,304
a training step on a CPU costs milliseconds: the default of README command (1) and of study_precision.py.

    python data/shakespeare_char/prepare.py                                    # the plays -> data/shakespeare_char/
    python data/shakespeare_char/prepare.py --input=my.txt --out_dir=data/my_char
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root, when run as a script
from data.shakespeare.prepare import main, source_text, write_dataset  # noqa: E402  (the same offline text)


def prepare(out_dir=HERE, input_path=None):
    text, source = source_text(input_path, out_dir)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(len(ids) * 0.9)
    meta = {'source': source, 'tokenizer': 'char', 'vocab_size': len(chars), 'chars': ''.join(chars)}
    return write_dataset(out_dir, {'train': ids[:n], 'val': ids[n:]}, meta)


if __name__ == '__main__':
    main(prepare, __doc__, HERE)
