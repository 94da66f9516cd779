"""
What the optimizer stores, end to end through the ZeRO stages (the kernel's own tests: test_kernels.py).
Every claim uses the oracle harness of test_zero.py: tiny GPT, fixed global batch, 2 gloo ranks, bf16 compute; the
last, the loss head's fp16 grads, model.py alone.

    python -m pytest -q test_precision.py
"""
import functools
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import model
import zero
from kernels import Precision
from test_zero import ON_CPU, TorchEngine, assert_same_run, run_ranks, tiny_model

BF16 = dict(param_dtype=torch.bfloat16, accum=4, steps=8)
MODES = {'remainder': Precision('remainder'), 'none': Precision('none'), 'bf16 state': Precision(state_dtype='bfloat16'),
         'int8 state': Precision(state_dtype='int8'), 'none + int8': Precision('none', 'int8'),
         'stochastic rounding': Precision('none', stochastic_rounding=True)}
# Every test's jobs, listed above it by name, run in one spawn of 2 ranks (spawned()): a spawn costs 3-5 s here, more
# than most jobs. A job two tests list runs once.
JOBS = {}


@functools.lru_cache(maxsize=None)
def spawned():
    """Every distinct job of JOBS in one spawn: {job: rank 0's result}, or the exception that ended the spawn."""
    jobs = list({key(job): job for jobs in JOBS.values() for job in jobs}.values())
    try:
        ranks_0 = run_ranks(2, jobs)
    except Exception as e:
        return e
    return {key(job): result for job, result in zip(jobs, ranks_0)}


def key(job):
    return tuple(sorted(job.items()))


def results(name):
    """Rank 0's results of the jobs JOBS[name], in order (a job that failed: its exception)."""
    out = spawned()
    if isinstance(out, Exception):
        raise AssertionError("the spawn of 2 ranks died (every test of this file that trains fails)") from out
    return [out[key(job)] for job in JOBS[name]]


JOBS.update({f'remainder, stage {stage}': [dict(kind=f'zero{stage}', **BF16, **extra)
                                           for extra in ({}, {'precision': MODES['remainder']})] for stage in (2, 3)})


@pytest.mark.parametrize('stage', [2, 3])
def test_remainder_master_is_bit_identical_to_the_fp32_master(stage):
    """bf16 params + int16 remainders are the fp32 master, exactly: same losses (difference 0) and, reconstructed,
    the same fp32 masters bit for bit. Both write the bf16 params rounded half away from zero (kernels.py)."""
    fp32, remainder = results(f'remainder, stage {stage}')
    assert_same_run(remainder, fp32, rtol=0, atol=0)
    assert remainder['populations']['master'] == (torch.int16, fp32['populations']['master'][1] // 2)


JOBS.update({f'elementwise {mode}': [dict(kind=f'zero{s}', param_dtype=torch.bfloat16, accum=2, steps=6,
                                          precision=MODES[mode]) for s in (1, 2, 3)]
             for mode in ('remainder', 'none', 'bf16 state')})


@pytest.mark.parametrize('mode', ['remainder', 'none', 'bf16 state'])
def test_an_elementwise_mode_gives_the_same_run_at_every_stage(mode):
    # one micro-step per rank, so every stage reduces the same grads the same way, and the modes are elementwise:
    # the stage only changes where each element lives, not its value. Stages 1 and 2 agree bit for bit. Stage 3
    # computes on its own per-unit buffers, and its bf16 losses move off in the last digits after a few steps
    # (1.5e-5 at step 6) with the default fp32 master too: not the mode, so it is compared within bf16 noise.
    one, two, three = results(f'elementwise {mode}')
    assert_same_run(two, one, rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(three['losses']), torch.tensor(two['losses']), rtol=1e-4, atol=0)


JOBS.update({f'every stage {mode}': [dict(kind=f'zero{s}', **BF16, precision=MODES[mode]) for s in (1, 2, 3)]
             + [dict(kind='zero1', **BF16)] for mode in MODES})  # the fp32 master


@pytest.mark.parametrize('mode', list(MODES))
def test_every_mode_trains_at_every_stage_and_holds_the_bytes_it_claims(mode):
    *runs, reference = results(f'every stage {mode}')
    start = {n: p.detach().float() for n, p in tiny_model(0).state_dict().items()}
    for stage, r in zip((1, 2, 3), runs):
        assert not isinstance(r, Exception), (stage, r)
        # trains: the losses follow the fp32 master's (uniform random tokens: from the counter-based init, whose loss
        # starts at ln(vocab), they cannot fall much) and every param matrix moved by Adam's lr-sized steps
        assert all(math.isfinite(x) for x in r['losses']), (stage, r['losses'])
        assert max(abs(a - b) for a, b in zip(r['losses'], reference['losses'])) < 0.01, (stage, r['losses'], reference['losses'])
        assert all((r['params'][n] - start[n]).abs().max() > 1e-3 for n in start if start[n].dim() == 2), stage
        padding = r['padded'] / r['psi'] - 1  # int8 pads every bucket's shards to 256 elements
        for line in r['report'].splitlines()[2:7]:  # counted vs estimated, per population (MB, 2 decimals)
            name, dtype, counted, estimate = line.split()
            assert float(estimate) - 0.01 <= float(counted) <= float(estimate) * (1 + padding) + 0.01, (stage, line)
    # stage 3 all-gathers a stored bf16 shard where there is no fp32 master, and a gathered unit then frees it
    # (fsdp_lite [Note: a gathered unit holds its shard once]); next to an fp32 master it gathers the master's rounding
    lends = MODES[mode].master_weights != 'fp32'
    assert runs[2]['lends'] == [lends] * len(runs[2]['lends']) and (runs[2]['held_twice'] == 0) == lends, runs[2]['held_twice']
    master = {'fp32': 'float32', 'remainder': 'int16', 'none': '-'}[MODES[mode].master_weights]
    state = {'float32': 'float32', 'bfloat16': 'bfloat16', 'int8': 'uint8+absmax'}[MODES[mode].state_dtype]
    assert f'master      {master}' in runs[0]['report'] and f'exp_avg     {state}' in runs[0]['report']


JOBS.update({f'checkpoint {mode}': [dict(kind='zero3', **BF16, precision=MODES[mode], **extra)
                                     for extra in ({}, {'resume_at': 4})]
             for mode in ('remainder', 'int8 state', 'none + int8', 'stochastic rounding')})


@pytest.mark.parametrize('mode', ['remainder', 'int8 state', 'none + int8', 'stochastic rounding'])
def test_a_checkpoint_carries_each_modes_state_exactly(mode):
    straight, resumed = results(f'checkpoint {mode}')
    assert_same_run(resumed, straight, rtol=0, atol=0)


JOBS.update({f'checkpoint fp32 master, stage {stage}': [dict(kind=f'zero{stage}', **BF16, **extra)
                                                          for extra in ({}, {'resume_at': 4})] for stage in (1, 2)})


@pytest.mark.parametrize('stage', [1, 2])
def test_a_checkpoint_of_bf16_compute_with_an_fp32_master_resumes_bit_identically_at_stages_1_and_2(stage):
    """The default precision with bf16 compute: the file holds the fp32 master alone (the bf16 params are its
    rounding), so a resume at the same layout makes the rounding again. Stage 3 casts the master as it gathers; stages
    1 and 2 gather the stored bf16 shard, which the load must write: left at its init, the first step after the
    resume runs on the init's params everywhere."""
    straight, resumed = results(f'checkpoint fp32 master, stage {stage}')
    assert_same_run(resumed, straight, rtol=0, atol=0)


JOBS.update({f'fp16 overflow, stage {stage}': [dict(kind=f'zero{stage}' if stage else 'ddp', param_dtype=torch.float16,
                                                     accum=4, steps=5, inf_at=2)] for stage in (0, 1, 2, 3)})


@pytest.mark.parametrize('stage', [0, 1, 2, 3])  # stage 0: torch's GradScaler, updated after a skipped step too
def test_fp16_overflow_on_one_rank_skips_that_step_everywhere_and_halves_the_scale(stage):
    # inside the ranks: masters, moments and step count unchanged on every rank by the step with the inf
    r = results(f'fp16 overflow, stage {stage}')[0]
    assert not isinstance(r, Exception), r
    assert r['scales'] == [2.0**16, 2.0**16, 2.0**15, 2.0**15, 2.0**15]  # after each step
    assert not math.isfinite(r['norms'][2]) and all(math.isfinite(n) for i, n in enumerate(r['norms']) if i != 2)
    start = {n: p.detach().float() for n, p in tiny_model(0).state_dict().items()}  # and it trains on, finitely:
    assert all(math.isfinite(x) for x in r['losses']) and all(  # (uniform tokens: the loss starts at ln(vocab))
        (r['params'][n] - start[n]).abs().max() > 1e-3 for n in start if start[n].dim() == 2)


JOBS.update({f'fp16 growth, stage {stage}': [dict(kind=f'zero{stage}', param_dtype=torch.float16, accum=2, steps=6,
                                                   inf_at=3, growth_interval=2)] for stage in (1, 3)})


@pytest.mark.parametrize('stage', [1, 3])
def test_fp16_loss_scale_doubles_after_growth_interval_clean_steps_and_counts_again_after_an_overflow(stage):
    r = results(f'fp16 growth, stage {stage}')[0]
    assert not isinstance(r, Exception), r
    # clean, clean (x2), clean, inf (/2, the count restarts), clean, clean (x2)
    assert r['scales'] == [2.0**16, 2.0**17, 2.0**17, 2.0**16, 2.0**16, 2.0**17]


def test_the_loss_scale_doubles_after_every_growth_interval_clean_steps_and_halves_at_every_overflow():
    """zero.LossScaler [Note: dynamic loss scaling]: each doubling starts a new count of clean steps, so a run that
    never overflows doubles its scale every growth_interval steps (torch's GradScaler too), not once; an overflow halves
    it and restarts the count. Disabled (fp32, bf16) it stays 1 whatever happens."""
    scaler, seen = zero.LossScaler(enabled=True, growth_interval=2), []
    for finite in [True] * 6 + [False, False] + [True] * 3:
        scaler.update(finite)
        seen.append(math.log2(scaler.scale))
    assert seen == [16, 17, 17, 18, 18, 19, 18, 17, 17, 18, 18], seen
    off = zero.LossScaler(enabled=False, growth_interval=2)
    for finite in (True, True, False, True, True):
        off.update(finite)
    assert off.scale == 1.0


def test_fp16_moments_hold_the_unscaled_grads_at_every_stage():
    """The fused step divides the loss scale out of the grads (its grad_scale = clip / scale) before they reach Adam's
    moments: after an fp16 step, exp_avg and exp_avg_sq are those of an fp32 step from the same weights, within fp16
    noise (9e-4 relative measured), not 2^16 and 2^32 times them. (Adam's update would hide a scale left in: m / sqrt(v)
    does not see it; the eps, a scale that changes mid-run and a checkpoint resumed in bf16 do.) Rank 0 of 2 under the
    fake process group."""
    dist.init_process_group('fake', rank=0, world_size=2, store=FakeStore())
    try:
        x = torch.randint(97, (2, 16), generator=torch.Generator().manual_seed(0))
        for stage in (1, 2, 3):
            moments = {}
            for dtype in (torch.float32, torch.float16):
                net = tiny_model(0)
                engine = zero.build_engine(net, zero.ZeroConfig(stage=stage, param_dtype=dtype, grad_clip=1.0),
                                           units=list(net.transformer.h), device=torch.device('cpu'))
                engine.backward(net(x, x)[1])
                assert math.isfinite(engine.step(1e-3))
                moments[dtype] = engine.exp_avg.clone(), engine.exp_avg_sq.clone()
            for fp32, fp16 in zip(moments[torch.float32], moments[torch.float16]):
                assert (fp16 - fp32).norm() <= 1e-2 * fp32.norm(), (stage, (fp16.norm() / fp32.norm()).item())
    finally:
        dist.destroy_process_group()


JOBS['fp16 vs fp32'] = [dict(kind='zero2', accum=4, steps=5, **extra) for extra in ({}, {'param_dtype': torch.float16})]


def test_fp16_loss_scaling_matches_bf16_free_training_within_fp16_noise():
    # the scale is applied before backward and removed exactly in the fused step: the run follows fp32's
    fp32, fp16 = results('fp16 vs fp32')
    torch.testing.assert_close(torch.tensor(fp16['losses']), torch.tensor(fp32['losses']), rtol=2e-3, atol=0)


class Bf16ReduceEngine(TorchEngine):
    """The oracle for reduce_dtype=bfloat16: each grad element rounded to bf16 and averaged over the ranks in bf16,
    then torch's clip and AdamW in fp32. accumulate='bf16' (stage 1's full flat grad): a step's micro-steps summed
    into a bf16 grad, reduced once; 'fp32' (stages 2 and 3): each micro-step reduced, the results summed in fp32."""

    def __init__(self, accumulate, model, grad_clip):
        super().__init__(model, model, grad_clip)
        self.accumulate, self.sync, self.grads = accumulate, True, None

    def set_grad_sync(self, sync):
        self.sync = sync

    def backward(self, loss):
        for p in self.params:
            p.grad = None
        loss.backward()
        new = [self.average(p.grad) if self.accumulate == 'fp32' else p.grad for p in self.params]
        if self.grads is None and self.accumulate == 'bf16':
            new = [g.to(torch.bfloat16) for g in new]
        self.grads = new if self.grads is None else [a.add_(g) for a, g in zip(self.grads, new)]  # bf16 += fp32: rounds
        if self.sync and self.accumulate == 'bf16':
            self.grads = [self.average(g) for g in self.grads]
        if self.sync:
            for p, g in zip(self.params, self.grads):
                p.grad = g.float()

    @staticmethod
    def average(grad):
        summed = grad.to(torch.bfloat16)
        dist.all_reduce(summed)  # two bf16 values, their sum rounded once; the halving is exact
        return summed.float() / dist.get_world_size()

    def step(self, lr):
        self.grads = None
        return super().step(lr)


SUM_IN = {dtype: functools.partial(Bf16ReduceEngine, dtype) for dtype in ('bf16', 'fp32')}  # (picklable, for spawn)
JOBS['bf16 reductions'] = [dict(kind=kind, accum=accum, **extra) for accum in (2, 4) for kind, extra in (
    ('ddp', {}), ('oracle', {'engine': SUM_IN['bf16']}), ('oracle', {'engine': SUM_IN['fp32']}),
    *((f'zero{s}', {'reduce_dtype': torch.bfloat16}) for s in (1, 2, 3)))]


def test_bf16_reductions_round_each_grad_once_and_average_the_ranks_in_bf16():
    """reduce_dtype=bfloat16, against Bf16ReduceEngine (torch's clip and AdamW on grads reduced as
    described there), at one and at two micro-steps a rank: stage 1 sums a step's micro-steps into its bf16 flat
    grad and reduces once; stages 2 and 3 reduce each micro-step and sum in fp32. Same losses, norms within 2e-5, params
    within 2e-4: a last-bit difference in step 1 (the clip's coefficient, from the norm's summation order) can move a
    grad across a bf16 rounding boundary in step 2, a 2^-8 jump that Adam carries into its update (up to 4e-5
    measured). Reducing in fp32 instead moves the params 3e-3 to 6e-3, and the other stage's way of summing the
    micro-steps 6e-3."""
    runs = results('bf16 reductions')
    for accum, (fp32, bf16_sum, fp32_sum, *stages) in zip((2, 4), (runs[:6], runs[6:])):
        for stage, r, oracle in zip((1, 2, 3), stages, (bf16_sum, fp32_sum, fp32_sum)):
            assert not isinstance(r, Exception), (stage, r)
            assert_same_run(r, oracle, rtol=2e-5, atol=1e-6, param_atol=2e-4)
            assert max((r['params'][n] - fp32['params'][n]).abs().max() for n in fp32['params']) > 1e-3, stage
            assert r['comm_bytes']['reduce_scatter'] == 2 * r['comm']['reduce_scatter'], stage  # sent: 2 bytes each
        assert stages[0]['populations']['grads'][0] == torch.bfloat16


ROUNDED = dict(param_dtype=torch.bfloat16, accum=2, steps=5, grad_clip=0.0, precision=MODES['stochastic rounding'])
JOBS['stochastic rounding at 2 ranks'] = [dict(kind=f'zero{stage}', **ROUNDED) for stage in (1, 2)]


def test_stochastic_rounding_draws_by_the_elements_place_in_the_model_so_1_and_2_ranks_train_alike():
    """Each update is rounded from a hash of (seed, step, element), the element's index in the model's flat layout,
    not in this rank's shard: rank 1 does not reuse rank 0's random numbers, and a run at 2 ranks is the run at 1 bit
    for bit. TINY is one bucket at either size (so the same layout); the same micro-batches, grads averaged exactly
    (a sum halved), no clipping (the norm's summation order would move the clip's last bit): nothing else differs."""
    alone = run_ranks(1, JOBS['stochastic rounding at 2 ranks'])
    for stage, one, two in zip((1, 2), alone, results('stochastic rounding at 2 ranks')):
        assert not isinstance(one, Exception) and not isinstance(two, Exception), (stage, one, two)
        assert one['n_buckets'] == two['n_buckets'] == 1
        assert_same_run(two, one, rtol=0, atol=0)


TIE = 1 + 2**-8  # every param at a tie between two bf16
JOBS.update({f'tie, stage {stage}': [dict(kind=f'zero{stage}', param_dtype=torch.bfloat16, steps=0, init_value=TIE,
                                          **extra) for extra in ({'precision': MODES['none']}, {})]
             for stage in (1, 2)})


@pytest.mark.parametrize('stage', [1, 2])
def test_every_rank_starts_from_the_params_as_their_owners_store_them(stage):
    # every param at a tie between two bf16 (1 + 2^-8): without a master the owner rounds it to nearest-even (1.0),
    # with an fp32 master half away from zero (1 + 2^-7); each rank's copy of every other rank's shard must agree
    none, fp32 = results(f'tie, stage {stage}')
    assert set(none['init_values']) - {0.0} == {1.0} and set(fp32['init_values']) - {0.0} == {1 + 2**-7}, (none, fp32)


def test_a_risky_combination_is_named_once_on_rank_0(tmp_path):
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py',
           'config/shakespeare_char.py', *ON_CPU, '--n_layer=1', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=2',
           '--eval_iters=2', '--max_iters=2', '--eval_interval=10', '--dtype=bfloat16', '--master_weights=none',
           '--state_dtype=int8', f'--out_dir={tmp_path}']
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    warnings = [line for line in out.stdout.splitlines() if line.startswith('warning:')]
    assert len(warnings) == 1 and "master_weights='none' with int8 state" in warnings[0]


def test_study_precision_quick_runs_every_pattern(tmp_path):
    # with no --out, into a temporary folder of its own: before, --quick overwrote the study's committed table
    committed = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'assets', 'precision.md')
    before = os.stat(committed).st_mtime_ns
    out = subprocess.run([sys.executable, 'study_precision.py', '--quick'], capture_output=True, text=True, timeout=600,
                         env={**os.environ, 'TMPDIR': str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    wrote = re.search(r'(?m)^wrote (.+)$', out.stdout)[1]
    assert os.stat(committed).st_mtime_ns == before and wrote.startswith(f'{tmp_path}/precision-quick-'), wrote
    rows = [line for line in open(wrote).read().splitlines() if line.startswith('| ') and 'pattern' not in line]
    assert len(rows) == 8
    remainder = next(r for r in rows if r.startswith('| remainder'))
    assert '| +0.0000 |' in remainder  # equal to the baseline, exactly
    # each row's final val loss is its run's last eval (one seed: the mean is that run's), as the run printed it
    printed = dict(re.findall(r'^(.+), seed 1337: val loss [\d.]+ -> ([\d.]+),', out.stdout, re.M))
    assert {r.split('|')[1].strip(): r.split('|')[2].split()[0] for r in rows} == printed, (rows, out.stdout)


def test_study_precisions_table_gives_each_patterns_mean_spread_and_difference_from_the_baseline():
    # study_precision.table from made-up runs, two seeds each: mean ± half the spread of the final losses, the pattern's
    # mean less the baseline's (positive: worse than the baseline), bytes/param and the mean tokens/s
    import study_precision
    run = lambda final, speed: dict(final=final, bytes_per_param=6.0, tokens_per_s=speed)  # noqa: E731
    results = {'fp32 master + fp32 state (baseline)': [run(1.50, 1000), run(1.52, 3000)],
               'no master + fp32 state': [run(1.60, 2000), run(1.64, 2000)]}
    text = study_precision.table(results, dict(study_precision.QUICK), [1, 2], 60.0)
    rows = [[c.strip() for c in line.strip('|').split('|')] for line in text.splitlines() if line.startswith('| ')]
    assert rows[1:] == [['fp32 master + fp32 state (baseline)', '1.5100 ± 0.0100', '+0.0000', '6.00', '2,000'],
                        ['no master + fp32 state', '1.6200 ± 0.0200', '+0.1100', '6.00', '2,000']], rows


def test_chunked_loss_head_in_fp16_keeps_the_small_grads_a_loss_scale_protects():
    """[Note: chunked loss head]: in fp16 the head's grads wait for the loss scale before they are divided by the
    token count. GPT-2's vocab at init: each probability / count is ~4e-8, below fp16's smallest number; before,
    every vocab row that no token of the batch targets got a grad of exactly 0."""
    torch.manual_seed(0)
    x, w = torch.randn(512, 32), 0.02 * torch.randn(50304, 32)  # p / count ~ 2e-5 / 512: fp16's smallest is 6e-8
    targets = torch.randint(50304, (512,))

    def grads(dtype, scale):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast('cpu', dtype=dtype, enabled=dtype != torch.float32):
            loss = model.linear_cross_entropy(xr, wr, targets, model.loss_chunk_rows(50304))
        (loss * scale).backward()  # a loss scale, as the fp16 GradScaler applies
        return xr.grad / scale, wr.grad / scale

    (gx, gw), (ref_x, ref_w) = grads(torch.float16, 1024.0), grads(torch.float32, 1.0)
    untargeted = torch.ones(50304, dtype=torch.bool)
    untargeted[targets] = False
    assert (gw[untargeted] - ref_w[untargeted]).norm() <= 1e-2 * ref_w[untargeted].norm()
    assert (gx - ref_x).norm() <= 1e-2 * ref_x.norm() and (gw - ref_w).norm() <= 1e-2 * ref_w.norm()
    # a small vocab, every target the same token, inputs of one sign: a chunk's weight grad sums its rows; 1024 rows
    # x 100 would pass fp16's 65504, 256 rows a chunk do not
    x2, w2, t2 = torch.full((4096, 8), 100.0), 0.02 * torch.randn(64, 8), torch.zeros(4096, dtype=torch.long)
    with torch.autocast('cpu', dtype=torch.float16):
        _, _, _, sums = model.chunked_cross_entropy(x2, w2, t2, model.loss_chunk_rows(64), grads=True)
    assert sums.isfinite().all() and sums[0, 0] < -300000
