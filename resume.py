"""
Which checkpoint a run resumes from, and whether it is whole: checkpoint.py saves and loads, this finds, checks and
reads (also for consolidate.py and sample.py, which read one).

    complete(out_dir), latest(out_dir)     the checkpoints with a manifest, oldest first; the newest
    read_manifest(path)                    the manifest, every file there at its full size
    verify(path, manifest, comm)           every file's CRC-32, each file read by one rank, a MAX telling them all
    find_resume(cfg, model_args)           the newest whole one, the damaged ones newer than it passed over
    set_aside(damaged, comm, log)          rank 0 renames each damaged one ckpt-N.damaged
    claim(out_dir)                         rank 0 of a training run locks out_dir: one run an out_dir
    check_shared(out_dir, ...)             every rank of a training run sees out_dir: one out_dir a run
    Shards(path, manifest)                 the fp32 values of any range of any param, from the rank files that hold it

Errors: Damaged (the checkpoint no longer holds what was saved: fall back, [Note: a damaged checkpoint]),
Unreadable (an I/O error: it may pass, no fallback), any other ValueError (another format, another model, nothing
left to train). Each is one line naming the file and the fix.
"""
import errno
import fcntl
import glob
import json
import os
import socket
import sys
import time
import zlib

import torch
import torch.distributed as dist

import configurator
import kernels
import launch

FORMAT = 1  # of the manifest that checkpoint.save writes
SHAPE_ARGS = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'vocab_size')  # dropout may change on resume


def complete(out_dir):
    """The complete checkpoint directories in out_dir (those with a manifest), oldest first."""
    return sorted(os.path.dirname(m) for m in glob.glob(os.path.join(out_dir, 'ckpt-*[0-9]', 'manifest.json')))


def latest(out_dir):
    """The newest complete checkpoint directory in out_dir, or None."""
    return (complete(out_dir) or [None])[-1]


def read_manifest(path):
    """The manifest, after checking the format and that every file is there with its full size. Damaged: the
    checkpoint no longer holds what was saved; ValueError: it was saved by a nanozero of another format."""
    where = os.path.join(path, 'manifest.json')
    try:
        with open(where) as f:
            manifest = json.load(f)
    except OSError as e:  # gone (a prune, a rename, a half-copied directory): damage; else an I/O error, no fallback
        raise (Damaged if isinstance(e, FileNotFoundError) else Unreadable)(f"{where}: cannot be read ({e})") from None
    except ValueError as e:
        raise Damaged(f"{where}: not a readable manifest ({e})") from None
    if not isinstance(manifest, dict):
        raise Damaged(f"{where}: a JSON {type(manifest).__name__}, not a manifest nanozero wrote")
    if manifest.get('format') != FORMAT:
        raise ValueError(f"{where}: format version {manifest.get('format')!r}, this nanozero reads {FORMAT}")
    missing = [k for k in ('iter_num', 'files', 'layout', 'model_args', 'config', 'stage', 'world_size') if k not in manifest]
    if missing:
        raise Damaged(f"{where}: no {', '.join(missing)}: not a manifest nanozero wrote (or one edited by hand)")
    files, crc32 = manifest['files'], manifest.get('crc32', {})  # no crc32: saved before checksums
    if not isinstance(files, dict) or not isinstance(crc32, dict) or crc32 and (
            set(crc32) != set(files) or any(type(v) is not int for v in crc32.values())):
        raise Damaged(f"{where}: its files and their CRC-32s do not match up: not a manifest nanozero wrote")
    for name, size in files.items():
        file = os.path.join(path, name)
        try:
            found = os.stat(file).st_size
        except FileNotFoundError:
            raise Damaged(f"{file} is missing (the manifest lists it): the checkpoint is incomplete") from None
        except OSError as e:  # EIO, ESTALE, EACCES: not known damage, as verify's file that could not be read
            raise Unreadable(f"{file} could not be looked at ({e.strerror or type(e).__name__}): run again, or move "
                             f"{path} aside") from None
        if found != size:
            raise Damaged(f"{file} is truncated or changed: {found:,} bytes, the manifest says {size:,}")
    return manifest


class Unreadable(ValueError):
    """A checkpoint file that could not be read or looked at (an I/O error, a stale handle): not known damage, and it may
    pass. read_manifest's is one rank's view (one node's); verify's is every rank's (a MAX over them)."""


class Damaged(ValueError):
    """A checkpoint that no longer holds what was saved: a file missing, cut short or changed, or a manifest that
    nanozero did not write. [Note: a damaged checkpoint]"""


class ChangedFile(Damaged):
    """A shard file that no longer holds what was saved; every rank of the load raises it (verify)."""


def verify(path, manifest, comm=None):
    """Every file's CRC-32 against the manifest's, before any of them is read. Each is read in full once in all:
    file i by rank i mod world size; a MAX over ranks of each file's flag (1: changed, 2: could not be read) tells
    every rank which failed, so all stop together with the same error, none left waiting in a collective (comm: the
    engine's; None, one process checks them all). Changed: ChangedFile (damage). Unreadable: a ValueError (an I/O
    error may pass: no fallback)."""
    names = sorted(manifest.get('crc32', {}))  # a manifest written before checksums: nothing to check
    if not names:
        return
    rank, world = (comm.rank, comm.world_size) if comm else (0, 1)
    crcs = [crc32_of(os.path.join(path, n)) if i % world == rank else manifest['crc32'][n] for i, n in enumerate(names)]
    flags = torch.tensor([2 if crc is None else int(crc != manifest['crc32'][n]) for crc, n in zip(crcs, names)],
                         dtype=torch.int64, device=comm.device if comm else 'cpu')
    if comm and world > 1 and not comm.fake:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=comm.process_group)  # start-up only: not counted
    flags = flags.tolist()
    if 2 in flags:
        raise Unreadable(f"{os.path.join(path, names[flags.index(2)])} could not be read (an I/O error on the rank "
                         "that checks it, not a changed file): run again, or " + ("move this ckpt-* directory aside to "
                         "resume from the one before" if comm else "name an older ckpt-* directory"))
    bad = [n for n, c in zip(names, flags) if c]
    if bad:
        more = f', as did {len(bad) - 1} more' * (len(bad) > 1)
        raise ChangedFile(f"{os.path.join(path, bad[0])} does not match the CRC-32 its manifest holds: it changed "
                          f"after it was saved (a disk or copy error){more}")


def crc32_of(file):
    """zlib's CRC-32 of the whole file; None where it cannot be read (an I/O error is a flag too, not a rank that
    stops alone while the others wait in verify's MAX)."""
    crc = 0
    try:
        with open(file, 'rb') as f:
            while chunk := f.read(64 << 20):
                crc = zlib.crc32(chunk, crc)
    except OSError:
        return None
    return crc


NO_FALLBACK = "put the file back from a copy, or start over in another out_dir (init_from='scratch')"


def claim(out_dir):
    """[Note: one run an out_dir] Rank 0 of a training run holds an exclusive lock on out_dir/.lock until its
    process ends (the returned file stays open): a second run on the same out_dir would delete the first one's
    .tmp directory mid-save, skip saves the other wrote first and prune the other's checkpoints. A crashed or
    restarted run's lock goes with its process. ValueError, naming the holder, if another run has it."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        lock = open(os.path.join(out_dir, '.lock'), 'a+')
    except OSError as e:  # before, found at the first save, after the training it would have kept
        raise ValueError(f"out_dir={out_dir!r} is not a directory this run can write to ({e.strerror})") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # a filesystem without locks (NFS without lockd, ...)
            print(f"warning: out_dir {out_dir} cannot be locked here ({e.strerror}): nothing keeps a second run out of it",
                  file=sys.stderr)
            return lock
        lock.seek(0)
        holder = lock.read().strip() or 'another process'
        lock.close()
        raise ValueError(f"out_dir {out_dir} is in use by another training run ({holder}): give this run its own "
                         f"out_dir, or wait for that one to end") from None
    try:
        lock.truncate(0)
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
        lock.flush()
    except OSError as e:  # a disk full: no room for the first checkpoint either
        raise ValueError(f"out_dir={out_dir!r} is not a directory this run can write to ({e.strerror})") from None
    return lock


# [Note: a restart of this job] torchrun --max-restarts=N starts every worker again after any failure, a config error of
# its first attempt included. A restart resumes a run from scratch from its own checkpoints, and one that dies after
# its last save ends without "nothing left to train"; but an attempt that stopped on another run's checkpoints (from
# scratch, or nothing left to train) must stop its restarts too, or they would train on from that run's checkpoint and
# prune it. So rank 0, once its checks have passed, writes the job's id into out_dir/.job, and a restart counts as one
# only where that file names this job: its rendezvous id (--standalone draws one; a static rendezvous has 'none', and
# keeps rank 0 on node 0: there the host and the torchrun agent, this process's parent). The other ranks cannot see
# rank 0's agent and keep the plain count: rank 0's refusal stops the job (its agent ends the other workers). Where
# 'none' is not a static rendezvous (c10d without --rdzv-id) and a restart moves rank 0 to another node, that restart
# refuses as a new run would, and says so: give torchrun --rdzv-id=<the job's id>. Where hosts and agents' pids repeat
# across jobs (containers, the agent as pid 1), two jobs look alike: a restart resumes any checkpoint, as before.


def check_shared(out_dir, rank, world_size, device, wait=2.0):
    """[Note: one out_dir for every rank] Every rank writes its shard of a checkpoint into out_dir, and rank 0 the
    manifest beside them once all are there; so out_dir must be one directory that every rank sees. Where a node has
    its own disk at that path (or a node's config names another out_dir), the run used to train until its first save,
    and fail there (resuming, the ranks could each find another checkpoint, or none). At the start
    instead: rank 0 makes a file of a random name there, and every rank looks for it (for up to `wait` seconds: a
    network filesystem may show a new file late). ValueError on every rank, naming those that do not see it."""
    if world_size == 1:
        return
    token, why = torch.zeros(1, dtype=torch.int64, device=device), 'on rank 0'
    if rank == 0:
        token.fill_(int.from_bytes(os.urandom(7), 'little') | 1)
        try:
            open(os.path.join(out_dir, f'.shared-{token.item()}'), 'w').close()
        except OSError as e:  # (a disk full since claim's checks): 0 tells every rank
            token.fill_(0)
            why = e.strerror
    dist.broadcast(token, src=0)  # after rank 0's file is made: rank 0 sends only then
    if token.item() == 0:
        raise ValueError(f"out_dir={out_dir!r} is not a directory this run can write to ({why})")
    path = os.path.join(out_dir, f'.shared-{token.item()}')
    deadline = time.monotonic() + wait
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    missing = launch.ranks_where(not os.path.exists(path), device)
    if rank == 0:
        os.remove(path)
    if missing:
        raise ValueError(f"out_dir={out_dir!r} is not one directory for every rank: rank(s) {configurator.spans(missing)} do not see the file "
                         f"rank 0 made there. Every rank writes its shard of a checkpoint into out_dir: put it on a "
                         f"filesystem every node shares (the same path on each), not a node's own disk"
                         + ("; a relative out_dir is found from each machine's working directory: give the shared "
                            "path in full" if not os.path.isabs(out_dir) else ''))


def job_id():
    run = os.environ.get('TORCHELASTIC_RUN_ID', 'none')
    return run if run != 'none' else f"{socket.gethostname()} {os.getppid()}"


def mark_job(out_dir):
    """Rank 0, its checks passed: out_dir is this job's ([Note: a restart of this job])."""
    os.makedirs(out_dir, exist_ok=True)  # (claim made it, where train.py's __main__ ran)
    with open(os.path.join(out_dir, '.job.tmp'), 'w') as f:
        f.write(job_id())
    os.replace(os.path.join(out_dir, '.job.tmp'), os.path.join(out_dir, '.job'))


def restart_of_this_job(out_dir):
    """On a torchrun restart: whether out_dir is this job's ([Note: a restart of this job])."""
    if int(os.environ.get('RANK', 0)) != 0:
        return True
    try:
        with open(os.path.join(out_dir, '.job')) as f:
            return f.read() == job_id()
    except OSError:
        return False


def find_resume(cfg, model_args, before=None):
    """(path, manifest, damaged) to resume from, or None. init_from='resume' needs a checkpoint; a worker restarted by
    torchrun (--max-restarts) resumes from the newest complete one when there is one, if its job's first attempt took
    out_dir ([Note: a restart of this job]). Newer ones found Damaged are
    passed over, (path, why) each in damaged, for load() to set aside ([Note: a damaged checkpoint]); every other
    problem is a ValueError naming the file, raised before any training step. before: only older ones (load's)."""
    attempt = int(os.environ.get('TORCHELASTIC_RESTART_COUNT', 0))
    restarted = attempt > 0 and restart_of_this_job(cfg['out_dir'])  # [Note: a restart of this job]
    again = " (again, in torchrun's restart: its first attempt did not take this out_dir; under a c10d rendezvous, give " \
            "--rdzv-id for restarts to know their job)" if attempt and not restarted else ''
    found = [p for p in complete(cfg['out_dir']) if before is None or p < before]
    if before and not found:
        raise Damaged(f"no older checkpoint to fall back on: {NO_FALLBACK}")
    if cfg['init_from'] != 'resume' and not restarted:
        if found:
            raise ValueError(f"{found[-1]} is a checkpoint of an earlier run and init_from='scratch': continue it with "
                             f"init_from='resume', or start over in another out_dir (or delete its ckpt-* directories){again}")
        return None
    if not found and restarted:  # died before its first checkpoint: start over
        return None
    if not found:
        raise ValueError(f"init_from='resume': no complete checkpoint (ckpt-*/manifest.json) in {cfg['out_dir']}")
    damaged = []
    for path in reversed(found):
        try:
            manifest = read_manifest(path)
            break
        except Damaged as e:
            damaged.append((path, str(e)))
    else:
        raise Damaged(f"{damaged[0][1]}; no older checkpoint to fall back on" + " that is not damaged too" * (len(found) > 1)
                      + f": {NO_FALLBACK}")
    if damaged and cfg.get('eval_only'):  # it holds no lock on out_dir: it sets nothing aside, nor evaluates another
        raise Damaged(f"{damaged[0][1]} (eval_only=True evaluates the newest checkpoint: move this one aside to "
                      f"evaluate {os.path.basename(path)})")
    if manifest['iter_num'] >= cfg['max_iters'] and not (restarted or cfg['eval_only']):
        raise ValueError(f"{path} is at iteration {manifest['iter_num']} and max_iters={cfg['max_iters']}: nothing is "
                         f"left to train; raise max_iters (or evaluate it with eval_only=True){again}")
    differ = {k: (manifest['model_args'].get(k), model_args.get(k)) for k in SHAPE_ARGS
              if manifest['model_args'].get(k) != model_args.get(k)}
    if differ:
        what = ', '.join(f"{k}={old} (the config says {new})" for k, (old, new) in differ.items())
        raise ValueError(f"{path}/manifest.json was saved by another model: {what}; resume with the same model "
                         f"or use another out_dir")
    return path, manifest, damaged

# [Note: a damaged checkpoint] A file missing, cut short, changed at its size (its CRC-32, verify) or a manifest that
# nanozero did not write: the checkpoint no longer holds what was saved, and no retry will change that. A resume then
# falls back to the newest one before it that is whole (keep_last keeps 2 by default), and rank 0 renames the damaged
# directory ckpt-N.damaged: kept for a look (it can be moved back), never resumed from or pruned, and out of the way of
# the save that writes ckpt-N again. Each rank decides from the same files (read_manifest) or the same MAX over ranks
# (verify), so all fall back alike; load() first checks that they resume one checkpoint, passing over as many, so that
# no collective pairs with another and nothing is renamed before they agree. Under torchrun --max-restarts a damaged
# newest checkpoint so costs the iterations since the one before, not the job. Errors, as before, with nothing whole
# to fall back on, and where the damage is not known: a file that could not be read (an I/O error may pass: run
# again), a manifest of another format (a newer nanozero wrote it), a checkpoint of another model; and with
# eval_only, which holds no lock on out_dir and evaluates the newest or nothing. A rename that fails stops every rank.


def set_aside(damaged, comm, log):
    """Rank 0 renames each damaged checkpoint ckpt-N.damaged and says so ([Note: a damaged checkpoint]); a rename
    that fails stops every rank with a Damaged, rank 0's with the reason (a MAX over the ranks: none is left waiting
    in a later collective)."""
    for path, why in damaged:
        aside, k, failed = path + '.damaged', 2, ''
        if comm.rank == 0:
            while os.path.exists(aside):  # damaged once before at this iteration: ckpt-N.2.damaged, ...
                aside, k = f"{path}.{k}.damaged", k + 1
            try:
                os.rename(path, aside)
                sync_directory(os.path.dirname(path) or '.')
            except OSError as e:
                failed = f" ({e.strerror})"
        flag = torch.tensor([len(failed)], dtype=torch.int64, device=comm.device)
        if comm.world_size > 1 and not comm.fake:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=comm.process_group)  # start-up only: not counted
        if flag.item():
            raise Damaged(f"{why}; it could not be set aside{failed}: move {path} aside by hand to resume from the one before")
        log(f"warning: {why}; set aside as {os.path.basename(aside)}, resuming from an older checkpoint")


def sync_directory(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -----------------------------------------------------------------------------
# read a checkpoint's shards, at any layout


class Shards:
    """A checkpoint's rank files, memory-mapped on first use: the fp32 values of any range of any param."""

    def __init__(self, path, manifest):
        self.path, self.manifest, self.files = path, manifest, {}
        self.where = {name: (bucket, offset) for bucket in manifest['layout'] for name, _, offset in bucket['params']}

    def file(self, rank):
        if rank not in self.files:
            name = os.path.join(self.path, f'rank{rank:05d}.pt')
            try:
                self.files[rank] = torch.load(name, map_location='cpu', mmap=True, weights_only=True)
            except Exception as e:  # after verify read it whole: gone since (a prune), or an I/O error on this rank
                raise Unreadable(f"{name}: cannot be read ({type(e).__name__}: {str(e)[:200]}): run again, or move this "
                                 "ckpt-* directory aside to resume from the one before") from None
        return self.files[rank]

    def decode(self, rank, population, lo, hi):
        """fp32 values of elements [lo, hi) of `rank`'s stored population."""
        f = self.file(rank)
        if population == 'master':
            master, param = f.get('master'), f.get('param')
            if master is None:
                return param[lo:hi].float()
            return kernels.join_master(param[lo:hi], master[lo:hi]) if master.dtype == torch.int16 else master[lo:hi].float()
        stored = f[population]
        if stored.dtype != torch.uint8:
            return stored[lo:hi].float()
        block = 256  # 8-bit state: shards are whole blocks, so element i's scale is absmax[i // 256]
        b0, b1 = lo // block, -(-hi // block)
        values = kernels.dequantize(stored[b0 * block:b1 * block], f[population + '_absmax'][b0:b1], signed=population == 'exp_avg')
        return values[lo - b0 * block:hi - b0 * block]

    def read(self, name, population, a, c):
        """fp32 values of elements [a, c) of param `name` (flattened), from whichever ranks hold them."""
        bucket, offset = self.where[name]
        size, out = bucket['shard_numel'], []
        g, end = offset + a, offset + c  # positions in the bucket's padded flat
        while g < end:
            rank = g // size
            stop = min(end, (rank + 1) * size)
            lo = bucket['shard_offset'] + g - rank * size
            out.append(self.decode(rank, population, lo, lo + stop - g))
            g = stop
        return torch.cat(out) if out else torch.zeros(0, device='cpu')
