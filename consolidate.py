"""
One nanoGPT-layout file from a sharded checkpoint (checkpoint.py), at whatever world size and stage it was saved:
no process group, no GPU.

    python consolidate.py out-shakespeare-char -o model.pt [--dtype bfloat16]   # an out_dir (its newest) or a ckpt-N
    python sample.py --ckpt=model.pt            (sample.py also reads a checkpoint directory directly)

Each param is read from whichever rank files hold its pieces (resume.Shards: memory-mapped, decoded to fp32 from
the form the run's precision stored), under model.py's names, padding removed, tied weights stored once:
GPT.load_state_dict(strict=True) accepts it. The tokenizer's meta rides along, for sample.py.
"""
import argparse
import os
import tempfile
import sys

import torch

import checkpoint
import kernels
import resume
from model import GPT, GPTConfig


def resolve(path):
    """A checkpoint directory, or an out_dir (its newest complete checkpoint)."""
    found = path if os.path.exists(os.path.join(path, 'manifest.json')) else resume.latest(path)
    if found is None:
        raise ValueError(f"{path}: neither a checkpoint (no manifest.json) nor an out_dir with one (ckpt-*/manifest.json)")
    return found


def full_state_dict(path, dtype=torch.float32):
    """(state dict with model.py's names and no padding, manifest). Tied weights are one tensor under both
    names (torch.save stores it once; GPT.load_state_dict(strict=True) finds both). Peak memory: the model
    plus the pages of the shards being read."""
    path = resolve(path)
    manifest = resume.read_manifest(path)
    resume.verify(path, manifest)  # every file's CRC-32, before any is read
    shards = resume.Shards(path, manifest)
    with torch.device('meta'):
        model = GPT(GPTConfig(**manifest['model_args']))
    names = {p: n for n, p in model.named_parameters()}
    frozen = shards.file(0).get('frozen', {})
    values = {}
    for p, name in names.items():
        value = frozen[name] if name in frozen else shards.read(name, 'master', 0, p.numel())
        # bf16: the training's own rounding of an fp32 master ([Note: one bf16 rounding rule] in kernels.py: ties away
        # from zero), so the file holds the params a bf16 run computed with; a value already bf16 stays as it is
        values[p] = (kernels.cast_param(value.view(p.shape).float(), dtype) if dtype == torch.bfloat16
                     else value.view(p.shape).to(dtype))
    return {key: values[p] for key, p in model.state_dict(keep_vars=True).items()}, manifest


def consolidate(path, out_file, dtype=torch.float32):
    """One file with everything sample.py needs, the tokenizer's meta included (GPT-2's BPE files are read from
    data/<dataset>/ or data/.cache/). Written to a temporary name and renamed: never a half-written model.pt."""
    tmp = out_file + '.tmp'
    if not os.path.isdir(os.path.dirname(os.path.abspath(out_file))):  # before reading the whole checkpoint
        raise ValueError(f"-o {out_file}: there is no directory {os.path.dirname(os.path.abspath(out_file))}: make it first")
    if os.path.isdir(out_file):
        raise ValueError(f"-o {out_file}: is a directory, give a file name")
    try:  # a file of its own made and removed there: a place we cannot write (/proc, read-only) fails now, before the read
        with tempfile.NamedTemporaryFile(dir=os.path.dirname(os.path.abspath(out_file))):
            pass
    except OSError as e:
        raise ValueError(f"-o {out_file}: cannot write there ({e.strerror})") from None
    state, manifest = full_state_dict(path, dtype)
    info = {k: manifest[k] for k in ('model_args', 'iter_num', 'best_val_loss', 'config', 'stage', 'world_size')}
    meta = manifest.get('meta') or checkpoint.dataset_meta(manifest['config']['dataset'])  # (a checkpoint before 27 Nov)
    try:
        checkpoint.write({'model': state, 'meta': meta, **info}, tmp)  # torch.save, synced; a write's OSError as itself
        os.replace(tmp, out_file)
    except OSError as e:  # a disk full, a quota
        raise ValueError(f"-o {out_file}: could not write it ({e.strerror})") from None
    finally:  # a failed write (disk full, Ctrl-C) leaves no stray .tmp beside the model
        if os.path.exists(tmp):
            os.remove(tmp)
    return manifest


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('path', help="a checkpoint directory (ckpt-N) or an out_dir (its newest complete checkpoint)")
    parser.add_argument('-o', '--output', default='model.pt')
    parser.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16'])
    args = parser.parse_args()
    try:
        manifest = consolidate(args.path, args.output, getattr(torch, args.dtype))
    except resume.Damaged as e:  # no fallback here: the user names the checkpoint
        sys.exit(f"checkpoint error: {e}; name an older ckpt-* directory")
    except ValueError as e:
        sys.exit(f"checkpoint error: {e}")
    print(f"{args.output}: iteration {manifest['iter_num']}, {args.dtype}, from stage {manifest['stage']} on "
          f"{manifest['world_size']} rank(s)")
