"""
Checkpoints that survive anything: sharded, atomic, resumable at another world size and stage, and
consolidated into one nanoGPT-layout file on demand (consolidate.py).

    out_dir/ckpt-00000250/rank00000.pt ...   each rank's own shards
    out_dir/ckpt-00000250/manifest.json      written last, by rank 0: the flat layout, config, iteration, ...

    python consolidate.py out-shakespeare-char -o model.pt [--dtype bfloat16]   # needs no GPU, no ranks
    python sample.py --ckpt=model.pt            (sample.py also reads a checkpoint directory directly)

A save writes what the rank owns and nothing else, one bucket at a time to host memory: its slices of the
masters (in the form its precision keeps them), exp_avg and exp_avg_sq. Stage 0 (DDP) has one copy of
everything, written by rank 0 as a 1-rank layout.

[Note: atomic checkpoints] Every rank writes into ckpt-N.tmp/; after a barrier rank 0 writes the manifest
(with every file's size and CRC-32, which each rank takes of the bytes as it writes them) and renames the directory
to ckpt-N. A rename is atomic, so a crash at any moment leaves either no ckpt-N or a complete one; resume takes the
newest directory with a manifest and checks every file against it: its size at once, its CRC-32 before a byte of it
is used (resume.verify: a file changed on disk or in a copy, even at its size, is found before a byte of it is used;
[Note: a damaged checkpoint] in resume.py says what happens then). Leftover .tmp
directories are removed by the next save, and only the newest keep_last complete checkpoints stay (the manifest is
deleted first, so a crash while pruning cannot leave a directory that looks complete). A restarted worker (torchrun
--max-restarts=N; train.py keeps each attempt's rendezvous apart, see launch.restart_store) resumes from the newest
one. A run from scratch refuses an out_dir that holds checkpoints: they belong to another run, and a restart or a
keep_last cleanup would mix the two; and no two runs train in one out_dir at once ([Note: one run an out_dir],
resume.claim). (Several nodes need out_dir on a shared filesystem: resume.check_shared, at the start.) A save that cannot write (a disk full, a quota,
an I/O error, on any rank) stops every rank together with NotSaved, its .tmp removed: the newest whole checkpoint stays.

[Note: resume anywhere] The manifest says where every param's elements live: bucket, offset, shard size,
world size. A run with the same layout copies its own file back, bit for bit. Any other world size, stage or bucket size
rebuilds its shards from the old ones: for each param piece it owns, it reads that range from whichever old ranks held
it (resume.Shards: memory-mapped, so only what is read is loaded: past verify, which reads each file once in all),
decoded to fp32, and stores it in its own precision. No conversion step for the user. Ranks and barriers are the
engine's process group's (engine.comm), not necessarily the whole job's.
"""
import glob
import json
import os
import shutil
import signal
import sys
import zlib

import torch
import torch.distributed as dist

import kernels
from resume import (FORMAT, ChangedFile, Damaged, Shards, complete, find_resume, set_aside, sync_directory,
                    verify)

POPULATIONS = ('master', 'exp_avg', 'exp_avg_sq')
DATA_KEYS = ('dataset', 'seed', 'batch_size', 'gradient_accumulation_steps')  # may change too: load() says so
ROOT = os.path.dirname(os.path.abspath(__file__))

# -----------------------------------------------------------------------------
# what a rank stores: its pieces of each bucket, and the layout that says whose they are


def layout(engine):
    """Per bucket: the params (name, shape, offset in the padded flat), sizes and where the shard lives."""
    if engine.stage == 0:  # one copy: a 1-rank layout, no padding
        names, sizes = {p: n for n, p in engine.model.named_parameters()}, [p.numel() for p in engine.params]
        return [dict(params=[[names[p], list(p.shape), sum(sizes[:i])] for i, p in enumerate(engine.params)],
                     numel=sum(sizes), padded_numel=sum(sizes), shard_numel=sum(sizes), shard_offset=0, flat_offset=0)]
    return [dict(params=[[engine.names[p], list(p.shape), o] for p, o in zip(b.params, b.offsets)], numel=b.numel,
                 padded_numel=b.padded_numel, shard_numel=b.shard_numel, shard_offset=b.shard_offset,
                 flat_offset=b.flat_offset) for b in engine.buckets]


def pieces(engine, b):
    """This rank's stored tensors for bucket b: whatever its precision keeps (see zero.py [Note: who holds the master])."""
    master, param = engine.step_tensors(b)
    absmax = engine.absmax_of(b) or (None, None)
    keeps_param = master is None or master.dtype == torch.int16  # part of the master (else only its rounding)
    out = dict(master=master, param=param if keeps_param else None, exp_avg=engine.exp_avg[b.shard_slice],
               exp_avg_sq=engine.exp_avg_sq[b.shard_slice], exp_avg_absmax=absmax[0], exp_avg_sq_absmax=absmax[1])
    return {name: t for name, t in out.items() if t is not None}


def rank_state(engine):
    """{name: host tensor}: this rank's pieces of every bucket (stage 0: of every param), one after another,
    each copied straight into its place in one host tensor per name (no second host copy)."""
    if engine.stage == 0:  # torch's AdamW keeps no moments for a param before its first step
        state = {p: engine.optimizer.state.get(p, {}) for p in engine.params}
        parts = [{'master': p.detach(), **{k: state[p].get(k, torch.zeros_like(p)) for k in POPULATIONS[1:]}}
                 for p in engine.params]
    else:
        parts = [pieces(engine, b) for b in engine.buckets]
    out = {}
    for name in parts[0]:
        out[name] = torch.empty(sum(part[name].numel() for part in parts), dtype=parts[0][name].dtype, device='cpu')
        for part, place in zip(parts, out[name].split([part[name].numel() for part in parts])):
            place.copy_(part[name].flatten())
    return out


def step_count(engine):
    if engine.stage == 0:  # torch's AdamW counts per param
        return int(engine.optimizer.state.get(engine.params[0], {}).get('step', 0))
    return engine.step_count

# -----------------------------------------------------------------------------
# save


def save(engine, cfg, model_args, iter_num, best_val_loss, log=print):
    """Every rank of the engine's process group calls it. Returns the path of the complete checkpoint, or raises NotSaved
    on every rank where any rank could not write its part."""
    rank, world_size = engine.comm.rank, engine.comm.world_size
    out_dir = cfg['out_dir']
    final = os.path.join(out_dir, f'ckpt-{iter_num:08d}')
    tmp = final + '.tmp'
    # saved already? e.g. the eval right after resuming from it. Rank 0's view decides, for all: another node's may be
    # stale (on NFS, a ckpt-N set aside and written again since), and a rank that returned here alone would leave
    # the others in the barrier below
    saved = torch.tensor([os.path.exists(os.path.join(final, 'manifest.json'))], dtype=torch.int64, device=engine.comm.device)
    if world_size > 1 and not engine.comm.fake:
        engine.comm.broadcast(saved)
    if saved.item():
        return final
    files = [f'rank{r:05d}.pt' for r in range(world_size if engine.stage else 1)]  # stage 0: one copy, rank 0's
    failed = None  # an OSError of this rank's: a disk full, a quota, an I/O error
    if rank == 0:
        log(f"saving checkpoint {final} ({len(files)} shard file(s))")
        # left by a crash: .tmp directories of earlier saves, and this save's ckpt-N if it has no manifest (a prune
        # or an rm -r cut short: not a checkpoint, and the rename below could not replace it)
        for stale in glob.glob(os.path.join(out_dir, 'ckpt-*.tmp')) + [final] * os.path.exists(final):
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.makedirs(tmp)
        except OSError as e:  # (a full disk has no block for a directory either)
            failed = e
    stop_together(engine, failed, tmp)
    if rank < len(files):
        state = rank_state(engine)
        if rank == 0:  # frozen params are not sharded: one copy
            state['frozen'] = {n: p.detach().cpu() for n, p in engine.model.named_parameters() if not p.requires_grad}
        try:
            crc = write(state, os.path.join(tmp, files[rank]))
            with open(os.path.join(tmp, files[rank] + '.crc32'), 'w') as f:  # for rank 0's manifest; removed there
                f.write(str(crc))
        except OSError as e:
            failed = e
        populations = {k: str(v.dtype)[6:] for k, v in state.items() if k != 'frozen'}
        del state  # the host copy goes before the barrier, not after the slowest rank
    fault_point('save', iter_num)
    stop_together(engine, failed, tmp)  # a barrier: every rank's file is complete, [Note: atomic checkpoints]
    if rank == 0:
        try:
            write_manifest(engine, cfg, model_args, iter_num, best_val_loss, files, populations, tmp)
            os.rename(tmp, final)
        except OSError as e:
            failed = e
        else:
            sync_directory(out_dir)  # the rename survives a power cut too
            prune(out_dir, cfg['keep_last'])
    stop_together(engine, failed, tmp)
    return final


class NotSaved(Exception):
    """A checkpoint that could not be written; every rank raises it at once, `own` where this rank's write failed."""

    def __init__(self, message, own):
        super().__init__(message)
        self.own = own


def stop_together(engine, error, tmp):
    """A barrier that also agrees whether any rank's write failed; if one did, every rank raises NotSaved (rank 0
    after removing the .tmp and what it holds), instead of the others waiting on it in a collective."""
    comm = engine.comm
    flag = torch.tensor([comm.rank + 1 if error else 0], dtype=torch.int64, device=comm.device)
    if comm.world_size > 1 and not comm.fake:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=comm.process_group)
    if flag.item():
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        who = comm.rank if error else flag.item() - 1  # (the highest-numbered rank that failed)
        raise NotSaved(f"{tmp[:-4]} not saved: rank {who} could not write it" + (f" ({error})" if error else ''),
                       own=error is not None)


def write_manifest(engine, cfg, model_args, iter_num, best_val_loss, files, populations, tmp):
    """Rank 0, once every rank's file is complete: the manifest, synced, then the directory's entries."""
    manifest = dict(format=FORMAT, iter_num=iter_num, best_val_loss=best_val_loss, config=cfg,
                    model_args=model_args, data_position=dict(seed=cfg.get('seed'), next_iteration=iter_num),
                    meta=dataset_meta(cfg['dataset']) if cfg.get('dataset') else {},  # the tokenizer, for sample.py
                    stage=engine.stage, world_size=engine.comm.world_size, param_dtype=str(engine.cfg.param_dtype)[6:],
                    precision=vars(engine.cfg.precision), populations=populations, step_count=step_count(engine),
                    loss_scale=scaler_state(engine), layout=layout(engine),
                    files={f: os.path.getsize(os.path.join(tmp, f)) for f in files}, crc32={})
    for f in files:
        with open(os.path.join(tmp, f + '.crc32')) as g:
            manifest['crc32'][f] = int(g.read())
        os.remove(os.path.join(tmp, f + '.crc32'))
    with open(os.path.join(tmp, 'manifest.json'), 'w') as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fault_point('manifest', iter_num)
    sync_directory(tmp)  # its entries (the files' names) survive a power cut, as the files themselves do


def write(obj, path):
    """torch.save to path, synced to disk; returns the CRC-32 of the bytes written (no second read)."""
    with open(path, 'wb') as f:
        summed = Crc32Writer(f)
        try:
            torch.save(obj, summed)
        except RuntimeError as e:  # torch's zip writer, closing after our write's OSError (a disk full) or a Ctrl-C
            # in it, raises its own "unexpected pos": the OSError (NotSaved) or the KeyboardInterrupt (one line) instead
            raise (e.__context__ if isinstance(e.__context__, (OSError, KeyboardInterrupt)) else e) from None
        f.flush()
        os.fsync(f.fileno())
    return summed.crc


class Crc32Writer:
    """The file torch.save writes to, summing the bytes as they pass (torch only ever calls write, in order): the
    checksum costs no second read of a file that may be gigabytes."""

    def __init__(self, f):
        self.f, self.crc = f, 0

    def write(self, data):
        self.crc = zlib.crc32(data, self.crc)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def prune(out_dir, keep_last):
    """Delete all but the newest keep_last complete checkpoints, each manifest first: a crash while deleting
    leaves a directory without a manifest (ignored, and deleted next time), never one that looks complete."""
    for old in set(glob.glob(os.path.join(out_dir, 'ckpt-*[0-9]'))) - set(complete(out_dir)[-keep_last:]):
        if os.path.exists(os.path.join(old, 'manifest.json')):
            os.remove(os.path.join(old, 'manifest.json'))
        shutil.rmtree(old, ignore_errors=True)


def scaler_state(engine):  # torch's GradScaler (stage 0) or zero.LossScaler: the same names; a disabled one has {}
    return {'scale': engine.scaler.get_scale(), 'clean_steps': engine.scaler.state_dict().get('_growth_tracker', 0)}


def load_loss_scale(engine, manifest):
    """scaler_state's inverse, from an fp16 run into an fp16 run only: a bf16 run resumed from fp16 would divide its
    grads by the saved 65536 for good (its scaler is off), an fp16 run resumed from bf16 would start at scale 1."""
    if manifest['param_dtype'] == 'float16' and engine.cfg.param_dtype == torch.float16:
        saved = manifest['loss_scale']  # GradScaler's state holds its factors too: they stay
        engine.scaler.load_state_dict({**engine.scaler.state_dict(), 'scale': saved['scale'],
                                       '_growth_tracker': saved['clean_steps']})


def fault_point(where, iteration):
    """A test hook: NANOZERO_FAULT=where:iteration:rank SIGKILLs that rank at 'step' (after an optimizer step),
    'save' (after it wrote its file) or 'manifest' (rank 0, before the rename). A comma-separated list: the k-th
    entry on torchrun's k-th restart (TORCHELASTIC_RESTART_COUNT), so one job can die in several places."""
    faults = os.environ.get('NANOZERO_FAULT', '').split(',')
    attempt = int(os.environ.get('TORCHELASTIC_RESTART_COUNT', 0))
    if attempt < len(faults) and faults[attempt] == f"{where}:{iteration}:{os.environ.get('RANK')}":
        os.kill(os.getpid(), signal.SIGKILL)

# -----------------------------------------------------------------------------
# load into an engine, at the same layout (bit for bit) or any other


def resume_notes(manifest, zero_cfg, cfg=None):
    """What a resumed run changes that load() converts or cannot keep, one line each: how the state is stored (the
    values are converted: exact where the new form holds every bit, else rounded once), and what draws the batches."""
    notes = []
    if manifest['precision'] != vars(zero_cfg.precision) or manifest['param_dtype'] != str(zero_cfg.param_dtype)[6:]:
        notes.append(f"note: stored as {kernels.Precision(**manifest['precision'])} with {manifest['param_dtype']} "
                     f"params; now {zero_cfg.precision} with {str(zero_cfg.param_dtype)[6:]} params: converted")
    changed = [f"{k} {manifest['config'].get(k)!r} -> {cfg[k]!r}" for k in DATA_KEYS
               if cfg is not None and manifest['config'].get(k) != cfg[k]]
    if changed:
        notes.append(f"note: {', '.join(changed)}: the batches from here on are not those the saved run would have drawn")
    return notes


def load(engine, path, manifest, damaged=(), log=print, cfg=None):
    """Restore the optimizer state, params and counters; returns (iter_num, best_val_loss). cfg (the run's config):
    say what the resumed run changes in how it stores the state or draws its batches, and fall back past a checkpoint
    that verify finds damaged. damaged: find_resume's, set aside first (resume.py [Note: a damaged checkpoint]). The ranks first
    check that they resume one checkpoint: their collectives (and rank 0's renames) wait for that."""
    engine.comm.check_same('checkpoint', [manifest['iter_num'], len(damaged)], "out_dir must be one directory that "
                           "every rank sees")
    set_aside(damaged, engine.comm, log)
    same = (manifest['stage'] in ({1, 2} if engine.stage in (1, 2) else {engine.stage})  # (1, 2: one stored form)
            and manifest['layout'] == layout(engine)
            and manifest['world_size'] == engine.comm.world_size
            and manifest['precision'] == vars(engine.cfg.precision) and manifest['param_dtype'] == str(engine.cfg.param_dtype)[6:])
    log(f"resuming from {path} (iteration {manifest['iter_num']}, stage {manifest['stage']} on {manifest['world_size']} "
        f"rank(s){'' if same else f'; rebuilding the shards for stage {engine.stage} on {engine.comm.world_size} rank(s)'})")
    for line in resume_notes(manifest, engine.cfg, cfg):
        log(line)
    try:
        verify(path, manifest, engine.comm)
    except ChangedFile as e:
        if cfg is None:
            raise
        if cfg.get('eval_only'):  # as find_resume: no fallback
            raise ChangedFile(f"{e} (eval_only=True evaluates the newest checkpoint: move this one aside to evaluate "
                              "an older one)") from None
        try:
            older = find_resume(cfg, manifest['model_args'], before=path)
        except ValueError as more:  # none older, or each older one's own reason
            raise Damaged(f"{e}; {more}") from None
        return load(engine, *older[:2], [(path, str(e))] + older[2], log=log, cfg=cfg)
    shards = Shards(path, manifest)
    with torch.no_grad():
        if engine.stage == 0:
            load_stage0(engine, shards, manifest)
        else:
            own = shards.file(engine.comm.rank) if same else None
            start = {}
            for b in engine.buckets:
                if same:  # copy back what was saved: bit for bit
                    for name, t in pieces(engine, b).items():
                        t.copy_(own[name][start.get(name, 0):start.get(name, 0) + t.numel()])
                        start[name] = start.get(name, 0) + t.numel()
                    engine.set_master(b, engine.master_values(b).clone())  # the params follow (fp32 master: its rounding)
                else:
                    rebuild(engine, b, shards)
                work = engine.gather_params(b)  # stages 1/2: every rank needs every new param
                if work is not None:
                    work.wait()
            engine.step_count = manifest['step_count']
        load_loss_scale(engine, manifest)
        for name, value in shards.file(0).get('frozen', {}).items():
            dict(engine.model.named_parameters())[name].data.copy_(value)
    return manifest['iter_num'], manifest['best_val_loss']


def rebuild(engine, b, shards):
    """This rank's shard of bucket b from another layout: each param piece it owns, read as fp32, stored anew."""
    lo = b.rank * b.shard_numel
    values = {pop: torch.zeros(b.shard_numel, device='cpu') for pop in POPULATIONS}  # the pads stay 0
    for p, offset in zip(b.params, b.offsets):
        a, c = max(lo - offset, 0), min(lo + b.shard_numel - offset, p.numel())
        for pop in POPULATIONS if a < c else ():
            values[pop][offset + a - lo:offset + c - lo] = shards.read(engine.names[p], pop, a, c)
    engine.set_master(b, values['master'].to(engine.device))
    absmax = engine.absmax_of(b)
    for k, pop in enumerate(('exp_avg', 'exp_avg_sq')):
        store = getattr(engine, pop)[b.shard_slice]
        if absmax is None:
            store.copy_(values[pop])
        else:  # 8-bit: requantized in this layout's blocks, one more rounding like the one every step makes
            codes, scales = kernels.quantize(values[pop].to(engine.device), signed=pop == 'exp_avg')
            store.copy_(codes)
            absmax[k].copy_(scales)


def load_stage0(engine, shards, manifest):
    names = {p: n for n, p in engine.model.named_parameters()}
    state = {}  # torch numbers the params in param-group order
    for i, p in enumerate(p for group in engine.optimizer.param_groups for p in group['params']):
        read = [shards.read(names[p], pop, 0, p.numel()).view(p.shape) for pop in POPULATIONS]
        p.data.copy_(read[0])
        state[i] = {'step': torch.tensor(float(manifest['step_count']), device='cpu'), 'exp_avg': read[1], 'exp_avg_sq': read[2]}
    engine.optimizer.load_state_dict({'state': state, 'param_groups': engine.optimizer.state_dict()['param_groups']})

# -----------------------------------------------------------------------------
# what the run trained on: consolidate.py and sample.py carry it with the model


def dataset_meta(dataset):
    """data/<dataset>/meta.json: the tokenizer ('gpt2', or 'char' with its alphabet); {} where it is absent."""
    path = os.path.join(ROOT, 'data', dataset, 'meta.json')
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


if __name__ == '__main__':  # this file's command until 27 Nov 2026
    sys.exit("python checkpoint.py consolidate ... is now python consolidate.py ... (the same arguments after it)")
