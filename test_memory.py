"""
The memory arithmetic as tests: `python zero.py estimate` against the ZeRO paper's figures and against what a
real run counts, zero_stage='auto', the activation formula against what autograd saves, the profiler's named
ranges, and `python bench.py scale` (rank 0 of a 64-rank job under the fake process group).

    python -m pytest -q test_memory.py
"""
import itertools
import json
import os
import re
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing._internal.distributed.fake_pg import FakeStore

import kernels
import launch
import memory
import train
import zero
from estimate import main as estimate_main  # (estimate, below: the command run in a process)
from model import GPT, GPTConfig
from test_comm import build, fake_world  # noqa: F401  fake_world: a fixture, for the tests below
from test_train import torchrun
from test_zero import TINY, run_ranks

QUIET = {**os.environ, 'OMP_NUM_THREADS': '1'}  # the tests share the machine's cores


def estimate(*args):
    out = subprocess.run([sys.executable, 'zero.py', 'estimate', *args], capture_output=True, text=True, timeout=120, env=QUIET)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def rows(text):
    """Per stage, the cells of a markdown table's rows '| 0 | ... |' to '| 3 | ... |'."""
    cells = [[c.strip() for c in line.strip('|').split('|')] for line in text.splitlines() if re.match(r'\| [0-3] \|', line)]
    assert [int(c[0]) for c in cells] == [0, 1, 2, 3], text
    return cells


def paper_rows(out):
    return rows(out.split('nanozero as configured')[0])


def configured_rows(out):
    return rows(out.split('nanozero as configured')[1])


# -----------------------------------------------------------------------------
# python zero.py estimate: the paper's model


PAPER = {  # (Ψ, N) -> per stage (params, grads, optimizer, total) GB: the ZeRO paper's 2Ψ + 2Ψ + 12Ψ, sharded
    (70e9, 64): [(140, 140, 840, 1120), (140, 140, 13.125, 293.125), (140, 2.1875, 13.125, 155.3125),
                 (2.1875, 2.1875, 13.125, 17.5)],
    (13e9, 8): [(26, 26, 156, 208), (26, 26, 19.5, 71.5), (26, 3.25, 19.5, 48.75), (3.25, 3.25, 19.5, 26.0)],
}


def sent(a):
    """The paper's communication per step, in Ψ, with a micro-steps per rank: stage 2 reduce-scatters each one."""
    return ['all-reduce 2Ψ', 'reduce-scatter Ψ + all-gather Ψ = 2Ψ', f'reduce-scatter {a}Ψ + all-gather Ψ = {a + 1}Ψ',
            f'{3 * a}Ψ (all-gather {2 * a}Ψ + reduce-scatter {a}Ψ)']


@pytest.mark.parametrize('psi, world', list(PAPER))
def test_estimate_prints_the_paper_tables_exactly(psi, world):
    out = paper_rows(estimate('--params', f'{psi:g}', '--world', str(world)))
    assert [tuple(float(c) for c in row[1:5]) for row in out] == PAPER[psi, world]  # not sums of rounded parts
    assert [row[5] for row in out] == sent(1)  # 2Ψ, 2Ψ, 2Ψ, 3Ψ


def test_the_readmes_auto_line_is_the_one_the_estimator_prints():
    # the README quotes this command's last line; it went stale once (stage 0's estimate began counting its casts,
    # 6.52 -> 6.77 GB, and the README kept 6.52)
    line = estimate('--config', 'config/gpt2_124m.py', '--world', '8', '--gpu_gb', '80').splitlines()[-1]
    readme = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'README.md')).read()
    assert line.startswith('zero_stage=auto: ') and f'\n{line}\n' in readme, line


@pytest.mark.parametrize('args, message', [
    (['--params', '70e9', '--world', '0'], "--world=0: use a number above 0"),  # was a ZeroDivisionError
    (['--params', '-5', '--world', '8'], "--params=-5.0: use a number above 0"),  # was a table of negative GB
    (['--params', '70e9', '--world', '8', '--set', 'zero_stage=5'], "zero_stage=5 is not a ZeRO stage"),
    (['--config', 'config/zero3.py', '--world', '8', '--set', 'n_head=7'], "n_embd=768 is not a multiple of n_head=7"),
    (['--params', '1e9', '--world', '8', '--set', 'n_head=0'], "n_head=0: use at least 1"),
    # train.py's value checks (config_problems), each once a traceback or a table of a config train.py refuses
    (['--config', 'config/zero3.py', '--world', '2', '--set', 'batch_size=0'], "batch_size=0: use at least 1"),
    (['--params', '1e9', '--world', '2', '--set', 'dtype=foo'], "dtype='foo': use one of"),
    (['--params', '1e9', '--world', '2', '--set', 'dtype=float64'], "dtype='float64': use one of"),
    (['--config', 'config/zero3.py', '--world', '2', '--set', 'n_layer=-1'], "n_layer=-1: use at least 1"),
    (['--params', 'nan', '--world', '8'], "--params=nan: use a number above 0"),
    (['--params', '1e9', '--world', '8', '--gpu_gb', 'inf'], "--gpu_gb=inf: use a number above 0")])
def test_estimate_refuses_what_it_cannot_estimate_in_one_line(capsys, args, message):
    with pytest.raises(SystemExit) as e:  # estimate.main is `python zero.py estimate`
        estimate_main(['estimate', *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.splitlines()[-1].startswith(f"python zero.py estimate: error: {message}"), err


def test_memory_py_run_as_a_script_points_to_zero_py_estimate():
    # before: exit code 0 and no output (memory.py is the estimator's module; its command line is zero.py's)
    out = subprocess.run([sys.executable, 'memory.py', 'estimate', '--params', '1e9', '--world', '8'],
                         capture_output=True, text=True, timeout=120, env=QUIET)
    assert (out.returncode, out.stdout, out.stderr) == (
        2, '', "memory.py is a module, not a command: run python zero.py estimate (--help for its options)\n")


def test_estimate_communication_with_accumulation_is_a_plus_1_psi_for_stage_2_and_3a_psi_for_stage_3():
    a = 4  # 32 micro-steps over 8 ranks
    out = paper_rows(estimate('--params', '13e9', '--world', '8', '--set', f'gradient_accumulation_steps={8 * a}'))
    assert [row[5] for row in out] == sent(a)
    assert [tuple(float(c) for c in row[1:5]) for row in out] == PAPER[13e9, 8]  # memory does not depend on a
    # with no --set, one micro-step a rank at any world, as the paper (before: train.py's default 8 over N, 4 at N = 2)
    assert [row[5] for row in paper_rows(estimate('--params', '7e9', '--world', '2'))] == sent(1)


def test_estimate_with_fewer_micro_steps_than_ranks_counts_one_micro_step_a_rank():
    """A config's gradient_accumulation_steps below --world (config/zero3.py's 40 at 64 ranks) is still one micro-step
    a rank, as bench.py scale runs it: not 0, which printed "reduce-scatter 0Ψ + all-gather Ψ = 1Ψ" for stage 2 and
    0 GB reduce-scattered in the configured table."""
    out = estimate('--params', '13e9', '--world', '8', '--set', 'gradient_accumulation_steps=4')
    assert [row[5] for row in paper_rows(out)] == sent(1)
    assert [row[7] for row in configured_rows(out)][1:] == [f"reduce_scatter {13 * 4:.4g}, all_gather {13 * 2 * g:.4g}"
                                                            for g in (1, 1, 2)]  # fp32 reductions, bf16 gathers: GB


# -----------------------------------------------------------------------------
# python zero.py estimate: nanozero as configured, against a real run's startup table


def startup_rows(report):
    """population -> (dtype, counted MB, estimated MB) from memory.startup_table's lines."""
    found = re.findall(r'^  (\w+)\s+(\S+)\s+([\d.]+)\s+([\d.]+)$', report, flags=re.M)
    return {name: (dtype, float(counted), float(est)) for name, dtype, counted, est in found}


def test_estimate_as_configured_equals_the_startup_table_of_a_real_two_rank_run(tmp_path):
    config = tmp_path / 'tiny.py'  # test_zero's TINY GPT, bf16 compute: params bf16, fp32 masters and grads
    config.write_text(''.join(f"{k} = {TINY[k]!r}\n" for k in ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias'))
                      + "dtype = 'bfloat16'\n")
    cfg = train.parse_config([str(config)])
    vocab = train.vocab_size(cfg)  # the config's (GPT-2's, 50304), for the real run too
    runs = run_ranks(2, [dict(kind=f'zero{s}', accum=2, steps=1, param_dtype=torch.bfloat16, model_kw=dict(vocab_size=vocab))
                         for s in (1, 2, 3)])
    cli = configured_rows(estimate('--config', str(config), '--world', '2'))
    for stage, run in zip((1, 2, 3), runs):
        assert not isinstance(run, Exception), run
        table = startup_rows(run['report'])
        assert list(table) == ['params', 'grads', 'master', 'exp_avg', 'exp_avg_sq']
        for name, cell in zip(table, cli[stage][1:6]):
            gb, dtype = cell.split()
            counted_dtype, counted_mb, estimate_mb = table[name]
            # the same estimate, printed as 4 significant digits of GB there and 2 decimals of MB here
            assert abs(float(gb) * 1e3 - estimate_mb) <= 0.005 + 5e-4 * estimate_mb, (stage, name, cell, table[name])
            assert dtype == counted_dtype, (stage, name)
        # counted and estimated differ by the pads alone: every population holds padded_numel (or its shard)
        # where the estimate has Ψ (or Ψ/N)
        psi, padded = run['psi'], run['padded']
        assert psi <= padded < psi + 2 * zero.ALIGN * run['n_buckets']  # < N * ALIGN elements a bucket
        zcfg = train.zero_config({**cfg, 'zero_stage': stage})
        estimated = memory.model_states(stage, psi, 2, zcfg)
        for name, (_, counted) in run['populations'].items():
            assert counted == pytest.approx(estimated[name][1] * padded / psi, rel=1e-12), (stage, name)


PRECISIONS = [  # (param_dtype, reduce_dtype, master_weights, state_dtype): every storage pattern, both reduce dtypes
    *((torch.bfloat16, reduce, master, state) for reduce in (torch.float32, torch.bfloat16)
      for master in ('fp32', 'remainder', 'none') for state in ('float32', 'bfloat16', 'int8')),
    *((torch.float32, torch.float32, 'fp32', state) for state in ('float32', 'bfloat16', 'int8')),
    (torch.float16, torch.float32, 'fp32', 'float32')]


def test_the_estimate_is_the_bytes_and_dtypes_counted_for_every_precision_mode_at_every_stage(fake_world):
    """model_states (what `python zero.py estimate` and zero_stage='auto' trust) against counted_states (the bytes of
    the engine's own tensors, the startup table's "counted"), population by population, dtype and bytes, for every
    storage pattern of the optimizer and both reduce dtypes, at 3 ranks (Ψ divides by nothing): they differ by the
    pads alone. Before, only the default precision was compared (test_estimate_as_configured...)."""
    fake_world(3)
    for stage, (param, reduce, master, state) in itertools.product((1, 2, 3), PRECISIONS):
        precision = kernels.Precision(master_weights=master, state_dtype=state)
        engine = build(stage, param_dtype=param, reduce_dtype=reduce, precision=precision)  # test_comm's tiny GPT
        counted, estimated = memory.counted_states(engine), memory.model_states(stage, engine.psi, 3, engine.cfg)
        assert list(counted) == list(estimated) == ['params', 'grads', 'master', 'exp_avg', 'exp_avg_sq']
        pads = engine.flat_numel / engine.psi  # every population holds the padded flat layout (or its shard)
        for name, (dtype, nbytes) in counted.items():
            why = (stage, param, reduce, master, state, name, counted[name], estimated[name])
            assert estimated[name][0] == dtype, why
            assert estimated[name][1] * pads == pytest.approx(nbytes, rel=1e-12, abs=1e-9), why


@pytest.mark.parametrize('stage', [1, 2, 3])
def test_the_estimated_communication_is_what_a_step_sends_at_the_configured_dtypes_with_accumulation(fake_world, stage):
    """memory.communication (the estimate table's "sent per step, GB") against what Comm counts in a step of 3
    micro-steps at 4 ranks, bf16 params and fp32 reductions: stage 1 reduce-scatters once a step, stages 2/3 each
    micro-step (aΨ), all-gathers at the params' 2 bytes, reduce-scatters at the reduce dtype's 4. Stage 3's figure
    counts every unit's backward re-gather (2aΨ), an upper bound of what it sends (the root and last unit are kept)."""
    a, world = 3, 4
    fake_world(world)
    engine = build(stage, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(97, (2, 16), generator=gen) for _ in range(2)) for _ in range(a)]
    train.train_step(engine, batches, 1e-3, nullcontext())  # warm-up: stage 3 learns its forward order
    engine.comm.numel.clear(), engine.comm.bytes.clear()
    train.train_step(engine, batches, 1e-3, nullcontext())
    estimated = memory.communication(stage, engine.psi, a, engine.cfg)
    pads = engine.flat_numel / engine.psi
    rs, ag = estimated['reduce_scatter'], estimated['all_gather']
    assert rs[1] == 4 * rs[0] and ag[1] == 2 * ag[0]  # bytes at fp32 reductions, bf16 gathers
    assert rs[0] * pads == engine.comm.numel['reduce_scatter'] and rs[1] * pads == engine.comm.bytes['reduce_scatter']
    assert engine.comm.bytes['all_gather'] == 2 * engine.comm.numel['all_gather']
    if stage < 3:
        assert ag[0] * pads == engine.comm.numel['all_gather'], (estimated, engine.comm.numel)
    else:
        assert ag[0] == 2 * a * engine.psi, estimated
        assert engine.comm.numel['all_gather'] <= ag[0] * pads, (estimated, engine.comm.numel)


# -----------------------------------------------------------------------------
# zero_stage='auto'


def test_the_roots_backward_holds_the_summed_embedding_grad_beside_the_roots_grad_buffer_in_bf16():
    """[Note: the peak], moment D, where the params' dtype is narrower than the reduce dtype (bf16 params, fp32 grads
    reduced): the embedding's grad summed into the pending one (2 bytes an element), then beside the root's fp32 grad
    buffer being filled from it (4 bytes): 6 bytes per root element, where two bf16 grads alone would say 4. A root far
    larger than a block, no activations: D is the peak. Stage 3 adds the gathered bf16 root, 2 bytes (an fp32 master:
    the gather's input is a cast of it, so the unit lends no shard)."""
    root, block = 10_000_000, 1000
    for stage, gathered in ((2, 0), (3, 2)):
        cfg = zero.ZeroConfig(stage=stage, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, bucket_mb=0.001)
        got = memory.transient_bytes(stage, cfg, block, root, psi=root + 10 * block, world=4)
        assert got == pytest.approx(root * (2 + 4 + gathered)), (stage, got / root)


def hand_estimates(world):
    """Per stage, bytes per rank for auto_config's GPT (fp32 compute and grads, 1 MiB buckets), written out from the
    formulas: model states + the worst moment of [Note: the peak]."""
    L, C, V, T, B = 4, 128, 256, 16, 1
    block = 12 * C * C + 2 * C  # c_attn 3C², attn c_proj C², c_fc 4C², mlp c_proj 4C², ln_1 and ln_2 gains (no biases)
    root = V * C + T * C + C  # wte (tied to lm_head), wpe, ln_f: 34,944, the largest unit is a block (196,864)
    psi = L * block + root  # 822,400
    per_block = B * T * C * (14 * 4 + 2 * 4)  # [Note: activation estimate], fp32
    blocks, head = L * per_block, B * T * 2 * 4 * C + 4 * V * C  # saved by the blocks; by the head (x's, the weight's grads)
    forward = V * (B * T * 4 + C * 4)  # one 16-row chunk of logits beside g.t() @ xi (vocab x C): > 2 chunks
    backward = B * T * C * 4 + V * C * 4  # the scaled grads of x and of the weight
    own = per_block + B * T * C * 8 * 4  # the first block's saved tensors and its backward temporaries

    def peak(bucket, gathered, stage):  # moments A, B (prefetch 1), C (prefetch + 1 blocks gathered), D
        return max(blocks + head + forward + gathered * (root + block),  # A: the last block kept gathered into backward
                   blocks + head + backward + gathered * (root + block),
                   blocks - per_block + 4 * root + max(own, 8 * bucket) + gathered * (root + 2 * block),
                   8 * root + gathered * root)  # D: two embedding grads, or their sum beside the root's grad buffer
    gathered = (1 - 1 / world) * 4  # stage 3: a gathered unit holds its own shard once
    return {0: 16 * psi + peak(0, 0, 0),  # torch DDP: fp32 params, grads, exp_avg, exp_avg_sq
            1: 4 * psi + 4 * psi + 12 * psi / world + peak(0, 0, 1),  # fp32 params, full flat_grad
            2: 4 * psi + 12 * psi / world + peak(2**20 // 4, 0, 2),  # 1 MiB buckets (> any param)
            3: 16 * psi / world + peak(block, gathered, 3)}


def auto_config(memory_gb):
    cfg = train.parse_config(['--n_layer=4', '--n_head=4', '--n_embd=128', '--block_size=16', '--batch_size=1',
                              '--dtype=float32', '--bucket_mb=1.0', '--zero_stage=auto', f'--memory_gb={memory_gb}'])
    return cfg, {**train.model_args(cfg, 256), 'vocab_size': 256}


def choose(cfg, device, world_size, args):
    """memory.choose_stage as train.py calls it for zero_stage='auto'."""
    return memory.choose_stage(cfg, train.zero_config({**cfg, 'zero_stage': 1}), device, world_size, args)


@pytest.mark.parametrize('expected', [0, 1, 2, 3])
def test_auto_picks_the_lowest_stage_that_fits_in_90_percent_of_the_memory(expected):
    need = hand_estimates(world=8)
    assert need[0] > need[1] > need[2] > need[3]  # 14.0, 8.6, 7.2, 5.3 MB: each limit lets one more stage in
    budget = (need[expected] + need[expected - 1]) / 2 if expected else 2 * need[0]  # between two stages' needs
    cfg, args = auto_config(memory_gb=budget / 0.9 / 1e9)
    stage, line = choose(cfg, torch.device('cpu'), 8, args)
    assert stage == expected, line
    assert f"-> stage {expected}, the lowest that fits" in line
    for s, bytes_needed in need.items():
        assert f"stage {s} {bytes_needed / 1e9:.3g}" in line  # the reasoning shows the same figures


def test_auto_says_when_activation_checkpointing_is_what_makes_a_stage_fit():
    cfg, args = auto_config(memory_gb=1.0)
    cfg.update(batch_size=64, activation_checkpointing=True)  # 1024 tokens: activations outweigh the model states
    model = GPT(GPTConfig(**args))
    psi, units = sum(p.numel() for p in model.parameters()), memory.unit_sizes(model, model.transformer.h)
    need = {ck: memory.stage_estimates(psi, 8, train.zero_config({**cfg, 'zero_stage': 1}),
                                       memory.activations(4, 128, 256, 64 * 16, 4, ck), *units) for ck in (False, True)}
    assert need[True][0] < min(need[False].values())  # with it stage 0 fits a limit that no stage fits without it
    cfg['memory_gb'] = (need[True][0] + min(need[False].values())) / 2 / 0.9 / 1e9
    stage, line = choose(cfg, torch.device('cpu'), 8, args)
    assert stage == 0 and line.endswith("activation_checkpointing=True is what makes stage 0 fit (without it: none)"), line
    with pytest.raises(ValueError, match=r"use activation_checkpointing=True \(then stage 0 fits\)"):
        choose({**cfg, 'activation_checkpointing': False}, torch.device('cpu'), 8, args)


def test_auto_keeps_10_percent_of_the_limit_as_headroom():
    """pick_stage: a stage fits when its estimate is at most 90% of the limit (HEADROOM, for fragmentation, the runtime
    and temporaries), not 1/1.1 of it nor any other share; the line says the budget it used."""
    assert memory.pick_stage({1: 0.899e9, 3: 0.5e9}, 1e9)[0] == 1
    assert memory.pick_stage({1: 0.901e9, 3: 0.5e9}, 1e9)[0] == 3  # within 1/1.1 (0.909) but not 0.9 of the limit
    assert memory.pick_stage({1: 0.901e9, 3: 0.91e9}, 1e9)[0] is None
    assert "limit 0.9 GB = 90% of 1 GB -> stage 3" in memory.pick_stage({1: 0.901e9, 3: 0.5e9}, 1e9)[1]


def test_auto_with_bf16_compute_counts_the_activations_in_bf16():
    """zero_stage='auto' and `python zero.py estimate --gpu_gb` with bf16 compute: the activations are 2-byte values
    (memory.activations' compute_bytes = the params' dtype), not fp32 ones, which would double them and pick a higher
    stage than needed (or none). Activations outweigh the model states here (64 x 16 tokens)."""
    cfg = train.parse_config(['--n_layer=4', '--n_head=4', '--n_embd=128', '--block_size=16', '--batch_size=64',
                              '--dtype=bfloat16', '--zero_stage=auto', '--memory_gb=1000'])
    args = {**train.model_args(cfg, 256), 'vocab_size': 256}
    model = GPT(GPTConfig(**args))
    psi, units = sum(p.numel() for p in model.parameters()), memory.unit_sizes(model, model.transformer.h)
    zcfg = train.zero_config({**cfg, 'zero_stage': 1})
    need = {a: memory.stage_estimates(psi, 8, zcfg, memory.activations(4, 128, 256, 64 * 16, a), *units) for a in (2, 4)}
    assert all(f"{need[2][s] / 1e9:.3g}" != f"{need[4][s] / 1e9:.3g}" for s in need[2])  # the line can tell them apart
    line = choose(cfg, torch.device('cpu'), 8, args)[1]
    assert all(f"stage {s} {need[2][s] / 1e9:.3g}" in line for s in need[2]), line
    # the estimator's CLI, on a config file (a CPU config: its dtype float32 set to bf16)
    out = estimate('--config', 'config/shakespeare_char.py', '--world', '8', '--gpu_gb', '80', '--set', 'batch_size=64',
                   '--set', 'dtype=bfloat16')
    cfg = train.parse_config(['config/shakespeare_char.py', '--batch_size=64', '--dtype=bfloat16'])
    act = memory.activation_bytes(cfg['n_layer'], cfg['n_embd'], train.vocab_size(cfg), 64 * cfg['block_size'], 2)
    assert f"activations of one micro-batch (64 x {cfg['block_size']} tokens): {act / 1e9:.3g} GB" in out, out


def test_on_a_cpu_without_memory_gb_the_ranks_of_a_machine_share_its_ram(monkeypatch):
    """device_memory_bytes on a CPU, memory_gb unset: the machine's RAM divided among the ranks torchrun started on it
    (LOCAL_WORLD_SIZE), else each of 8 ranks would plan with all of it and zero_stage='auto' pick a stage 8x too big."""
    monkeypatch.setattr(dist, 'is_initialized', lambda: False)
    ram = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    monkeypatch.delenv('LOCAL_WORLD_SIZE', raising=False)
    assert memory.device_memory_bytes(torch.device('cpu')) == ram
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '8')
    assert memory.device_memory_bytes(torch.device('cpu')) == ram / 8
    assert memory.device_memory_bytes(torch.device('cpu'), memory_gb=2.0) == 2e9  # memory_gb: the rank's own, as given


def test_auto_says_checkpointing_is_what_makes_a_lower_stage_fit_when_without_it_a_higher_one_would():
    """lowest_stage_that_fits' note: with activation_checkpointing=True, when without it the lowest stage that fits is
    a higher one (not only when none fits), the line says so and names that stage."""
    cfg, args = auto_config(memory_gb=1.0)
    cfg.update(batch_size=16, activation_checkpointing=True)
    model = GPT(GPTConfig(**args))
    psi, units = sum(p.numel() for p in model.parameters()), memory.unit_sizes(model, model.transformer.h)
    need = {ck: memory.stage_estimates(psi, 8, train.zero_config({**cfg, 'zero_stage': 1}),
                                       memory.activations(4, 128, 256, 16 * 16, 4, ck), *units) for ck in (False, True)}
    budget = (need[False][1] + need[False][2]) / 2
    assert need[True][0] > budget >= need[True][1] and need[False][1] > budget >= need[False][2]  # 1 with it, 2 without
    cfg['memory_gb'] = budget / 0.9 / 1e9
    stage, line = choose(cfg, torch.device('cpu'), 8, args)
    assert stage == 1 and line.endswith("activation_checkpointing=True is what makes stage 1 fit (without it: 2)"), line


def test_the_heads_backward_counts_the_weight_grads_cast_to_bf16_params():
    """[Note: the peak], moment B, bf16 params (stages 1-3): the weight grad's cast to the params' dtype (root_numel x 2
    bytes) beside the head's backward; fp32 params need no cast. A huge head backward: B is the peak."""
    root, block, big = 10_000, 100, 10**7
    act = memory.Activations(0, 0, 0, 0, 0, big)
    for stage in (1, 2):
        for param, cast in ((torch.bfloat16, 2 * root), (torch.float32, 0)):
            cfg = zero.ZeroConfig(stage=stage, param_dtype=param)
            got = memory.transient_bytes(stage, cfg, block, root, root + 4 * block, 4, act)
            assert got == big + cast, (stage, param, got)


def test_stage_2s_grad_buffer_moment_holds_a_bucket_of_param_dtype_grads_beside_its_reduce_dtype_buffer():
    """[Note: the peak], moment C at stage 2, no activations: the grads as autograd made them (param_dtype, 2 bytes)
    beside the bucket's grad buffer (reduce_dtype, 4 bytes), for a bucket of bucket_mb (a block at least) but never
    more than the whole model: 25 MB of fp32 grads are 6.5M elements, this model 401,000."""
    root, block = 1000, 100_000
    psi = root + 4 * block
    for bucket_mb, bucket in ((25.0, psi), (1.0, 2**20 // 4), (0.001, block)):
        cfg = zero.ZeroConfig(stage=2, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, bucket_mb=bucket_mb)
        got = memory.transient_bytes(2, cfg, block, root, psi, 4)
        assert got == 2 * root + bucket * (2 + 4), (bucket_mb, got)  # the pending embedding grad + the moment


@pytest.mark.parametrize('master', ['fp32', 'remainder', 'none'])
def test_stage_3s_gathered_units_lend_their_shard_unless_the_gather_casts_an_fp32_master(master):
    """fsdp_lite [Note: a gathered unit holds its shard once]: with bf16 params stored (master_weights 'remainder' or
    'none') the gather's input is the stored shard, so a gathered unit adds (1 - 1/N) of its bytes; from an fp32 master
    the input is a cast, and the whole unit counts. Moment A (a huge head forward): the root and the last unit."""
    root, block, world, big = 1000, 100, 4, 10**6
    cfg = zero.ZeroConfig(stage=3, param_dtype=torch.bfloat16, precision=kernels.Precision(master_weights=master))
    got = memory.transient_bytes(3, cfg, block, root, root + 6 * block, world, memory.Activations(0, 0, 0, 0, big, 0))
    share = 2 * (1 if master == 'fp32' else 1 - 1 / world)
    assert got - big == pytest.approx(share * (root + block))


@pytest.mark.parametrize('reshard', [True, False])
@pytest.mark.parametrize('prefetch', [0, 1, 2])
def test_stage_3s_estimate_holds_the_last_unit_in_the_heads_forward_and_backward(prefetch, reshard):
    """fsdp_lite [Note: the last unit stays gathered]: (A) counts the root and the last block unit, (B) the root and
    the last unit or the `prefetch` units the root's pre-backward gathers; every block without reshard_after_forward.
    Each moment alone decides the peak here (a huge activation term in it)."""
    root, block, world, big = 1000, 100, 4, 10**6
    psi, share = root + 6 * block, 4 * (1 - 1 / world)  # fp32: a gathered unit lends its shard
    cfg = zero.ZeroConfig(stage=3, param_dtype=torch.float32, prefetch=prefetch, reshard_after_forward=reshard)
    blocks = (lambda n: n * block) if reshard else (lambda n: 6 * block)
    moment_a = memory.transient_bytes(3, cfg, block, root, psi, world, memory.Activations(0, 0, 0, 0, big, 0))
    moment_b = memory.transient_bytes(3, cfg, block, root, psi, world, memory.Activations(0, 0, 0, 0, 0, big))
    assert moment_a - big == pytest.approx(share * (root + blocks(1)))
    assert moment_b - big == pytest.approx(share * (root + blocks(max(1, prefetch))))


def test_blocks_per_unit_moves_only_stage_3s_estimate_and_by_its_larger_units():
    """fsdp_lite [Note: blocks per unit]: stages 0-2 ignore the setting; stage 3 holds k blocks where it held one (the
    prefetch + 1 gathered units, the unit's grad buffer), never more than every block."""
    model = GPT(GPTConfig(n_layer=6, n_head=4, n_embd=128, block_size=64, vocab_size=256))
    psi, (block, root) = sum(p.numel() for p in model.parameters()), memory.unit_sizes(model, model.transformer.h)
    act = memory.activations(6, 128, 256, 512, 2, False)
    cfg = dict(param_dtype=torch.bfloat16, bucket_mb=0.001)  # stage 2's bucket: a block's grads at least
    need = {k: memory.stage_estimates(psi, 8, zero.ZeroConfig(**cfg, blocks_per_unit=k), act, block, root)
            for k in (1, 2, 6, 12)}
    assert all(need[k][s] == need[1][s] for k in need for s in (0, 1, 2))
    assert need[1][3] < need[2][3] < need[6][3] == need[12][3]  # 12 blocks a unit of 6: all of them, as 6 a unit


def test_auto_never_picks_stage_0_with_a_precision_mode_that_torch_adamw_cannot_honour():
    cfg = train.parse_config(['--n_layer=4', '--n_head=4', '--n_embd=128', '--block_size=16', '--batch_size=1',
                              '--dtype=bfloat16', '--master_weights=remainder', '--zero_stage=auto', '--memory_gb=1000'])
    stage, line = choose(cfg, torch.device('cpu'), 8, {**train.model_args(cfg, 256), 'vocab_size': 256})
    assert stage == 1 and 'stage 0' not in line, line  # everything fits; with the default precision: stage 0
    default = train.parse_config(['--n_layer=4', '--n_head=4', '--n_embd=128', '--block_size=16', '--batch_size=1',
                                  '--dtype=bfloat16', '--zero_stage=auto', '--memory_gb=1000'])
    assert choose(default, torch.device('cpu'), 8, {**train.model_args(default, 256), 'vocab_size': 256})[0] == 0
    out = subprocess.run([sys.executable, 'zero.py', 'estimate', '--config', 'config/shakespeare_char.py', '--world', '2',
                          '--gpu_gb', '80', '--set', 'dtype=bfloat16', '--set', 'master_weights=remainder'],
                         capture_output=True, text=True, timeout=120)
    assert '-> stage 1, the lowest that fits' in out.stdout, out.stdout[-1500:] + out.stderr[-1500:]  # the estimator too


def test_auto_when_nothing_fits_is_a_clear_error(monkeypatch, tmp_path):
    cfg, args = auto_config(memory_gb=0.5 * hand_estimates(world=8)[3] / 1e9)
    with pytest.raises(ValueError, match=r"-> none fits: use more ranks, a smaller batch_size or block_size, or set "
                                         r"memory_gb$"):
        choose(cfg, torch.device('cpu'), 8, args)
    # on a GPU the limit is its free memory (mem_get_info, stood in for): memory_gb would change nothing, so not named
    monkeypatch.setattr(torch.cuda, 'mem_get_info', lambda device=None: (0.5 * hand_estimates(world=8)[3], 80e9))
    with pytest.raises(ValueError, match=r"-> none fits: use more ranks, a smaller batch_size or block_size$"):
        choose(cfg, torch.device('cuda', 0), 8, args)
    # in train.py, every rank knows at once (the least memory of any rank): one line, exit code 1, no traceback
    out = subprocess.run([sys.executable, 'train.py', 'config/shakespeare_char.py', '--device=cpu', '--dtype=float32',
                          '--zero_stage=auto', '--memory_gb=0.000001', '--n_layer=1', '--n_head=2', '--n_embd=32',
                          '--block_size=16', '--batch_size=2', f'--out_dir={tmp_path}'], capture_output=True, text=True,
                         timeout=120, env=QUIET)
    assert out.returncode == 1 and out.stderr.count('\n') == 1 and out.stderr.startswith('config error: ') and (
        'none fits: use more ranks, a smaller batch_size or block_size, or set memory_gb' in out.stderr), out.stderr


def _auto_with_unequal_memory(rank, init, out):
    dist.init_process_group('gloo', init_method=f'file://{init}', rank=rank, world_size=2)
    need = hand_estimates(world=2)
    free = [2 * need[0], (need[1] + need[2]) / 2][rank] / 0.9  # rank 0 alone would pick stage 0, rank 1 stage 2
    cfg, args = auto_config(memory_gb=free / 1e9)  # as mem_get_info on two GPUs of one job
    torch.save(choose(cfg, torch.device('cpu'), 2, args), os.path.join(out, f'rank{rank}.pt'))
    launch.end_process_group(torch.device('cpu'))  # [Note: the end of a run]: a gloo worker may still hold the MIN's tensor


def test_auto_picks_one_stage_for_every_rank_from_the_least_memory(tmp_path):
    mp.spawn(_auto_with_unequal_memory, args=(str(tmp_path / 'init'), str(tmp_path)), nprocs=2)
    picked = [torch.load(tmp_path / f'rank{r}.pt')[0] for r in range(2)]
    assert picked == [2, 2], picked


def test_on_a_gpu_the_limit_is_its_free_memory_and_memory_gb_is_ignored(monkeypatch):
    """memory.device_memory_bytes' CUDA branch, torch.cuda.mem_get_info stood in for (free, total): the limit is what
    the rank's own GPU has free, not its total (another process's memory is not ours), and memory_gb, the CPU's
    setting, changes nothing on a GPU."""
    asked = []
    monkeypatch.setattr(torch.cuda, 'mem_get_info', lambda device=None: asked.append(device) or (7e9, 80e9))
    monkeypatch.setattr(dist, 'is_initialized', lambda: False)  # one rank: no MIN over a process group
    gpu = torch.device('cuda', 3)
    assert memory.device_memory_bytes(gpu) == 7e9
    assert memory.device_memory_bytes(gpu, memory_gb=16.0) == 7e9
    assert asked == [gpu, gpu]
    assert memory.device_memory_bytes(torch.device('cpu'), memory_gb=16.0) == 16e9  # where memory_gb does count
    # in a process group the least of any rank's, on the rank's GPU (NCCL takes no CPU tensor), in float64 (bytes
    # past 2^24 lose their low digits in float32); torch.tensor and the all-reduce stood in for, another rank has 5e9
    made, reduced = [], []
    real_tensor = torch.tensor
    monkeypatch.setattr(dist, 'is_initialized', lambda: True)
    monkeypatch.setattr(torch, 'tensor', lambda data, **kw: made.append(kw) or real_tensor(data, dtype=kw['dtype']))
    monkeypatch.setattr(dist, 'all_reduce', lambda t, op: reduced.append(op) or t.fill_(min(t.item(), 5e9)))
    assert memory.device_memory_bytes(gpu) == 5e9
    assert made == [dict(dtype=torch.float64, device=gpu)] and reduced == [dist.ReduceOp.MIN]


def test_auto_in_a_real_run_prints_its_reasoning_and_trains_with_the_stage_it_picked(tmp_path):
    # test_train's torchrun: config/shakespeare_cpu.py, 1 layer x 32, 2 ranks; a limit that stage 1 fits, stage 0 not
    cfg = train.parse_config(['config/shakespeare_cpu.py', '--n_layer=1', '--n_head=2', '--n_embd=32', '--block_size=16',
                              '--batch_size=2'])
    args = train.model_args(cfg, train.vocab_size(cfg))
    with torch.device('meta'):
        model = GPT(GPTConfig(**args))
    psi = sum(p.numel() for p in model.parameters())
    act = memory.activations(1, 32, args['vocab_size'], 2 * 16, 4)
    need = memory.stage_estimates(psi, 2, train.zero_config({**cfg, 'zero_stage': 1}), act,
                                  *memory.unit_sizes(model, model.transformer.h))
    assert need[1] < need[0]
    out = torchrun(2, f'--out_dir={tmp_path}', '--zero_stage=auto', f'--memory_gb={(need[0] + need[1]) / 2 / 0.9 / 1e9}',
                   '--max_iters=1', '--eval_interval=1')
    line = next(line for line in out.splitlines() if line.startswith('zero_stage=auto: '))
    assert line.endswith('-> stage 1, the lowest that fits') and 'zero_stage=1, N=2' in out


# -----------------------------------------------------------------------------
# activations


def saved_by_autograd(model, x, y, autocast):
    """Bytes of the distinct storages autograd saves for backward in one forward, the params' own left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()  # views of one storage (q, k, v) count once
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(x, y)
    return sum(saved.values())


@pytest.mark.parametrize('L, C, V, T', [(2, 64, 512, 96), (3, 128, 256, 32), (1, 32, 2048, 64)])  # tokens = 2T != C
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_activation_formula_matches_what_autograd_saves_within_2_percent(L, C, V, T, dtype):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=L, n_head=4, n_embd=C, block_size=T, vocab_size=V, bias=False)).to(dtype)
    x, y = torch.randint(V, (2, 2, T))
    autocast = nullcontext() if dtype == torch.float32 else torch.autocast('cpu', dtype)
    saved = saved_by_autograd(model, x, y, autocast)
    formula = memory.saved_bytes(L, C, V, 2 * T, dtype.itemsize)
    if dtype == torch.bfloat16:  # CPU autocast keeps layer_norm in bf16, where CUDA's runs it (and saves its input) in
        formula -= 2 * T * (2 * L + 2) * C * (4 - dtype.itemsize)  # fp32: 2 per block, ln_f's input and output grad
    assert abs(formula / saved - 1) < 0.02, (saved, formula)  # left out: norm statistics, logsumexps, token ids

ACTIVATION_PEAK = """
import re, sys, torch
import fsdp_lite
from model import GPT, GPTConfig
def rss(field): return int(re.search(field + r':\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)) * 1024
L, C, V, B, T = map(int, sys.argv[1:6])
model = GPT(GPTConfig(n_layer=L, n_head=4, n_embd=C, block_size=T, vocab_size=V, bias=False))
if sys.argv[6] == '1':
    fsdp_lite.checkpoint_activations(model.transformer.h)
x, y = torch.randint(V, (2, B, T))
model(x, y)[1].backward()  # warm-up: the grads exist, the kernels are initialised
base = rss('VmRSS')
open('/proc/self/clear_refs', 'w').write('5')  # VmHWM := VmRSS
model(x, y)[1].backward()
print(rss('VmHWM') - base)
"""


def test_activation_checkpointing_saves_the_memory_the_estimate_says():
    """The peak RSS of a forward + backward above the warm process (fresh processes; MALLOC_MMAP_THRESHOLD_ so freed
    buffers leave the RSS), with and without checkpointing: the difference is what activation_bytes says it is."""
    L, C, V, B, T = 8, 256, 128, 4, 256  # blocks dominate: 138 MB of activations without checkpointing, 28 with
    peaks = [int(subprocess.run([sys.executable, '-c', ACTIVATION_PEAK, *map(str, (L, C, V, B, T, ck))], capture_output=True,
                                text=True, check=True, env={**QUIET, 'MALLOC_MMAP_THRESHOLD_': '65536'}).stdout) for ck in (0, 1)]
    estimates = [memory.activation_bytes(L, C, V, B * T, 4, checkpointing=ck) for ck in (False, True)]
    saved, estimated = peaks[0] - peaks[1], estimates[0] - estimates[1]
    assert abs(saved / estimated - 1) < 0.05, (peaks, estimates)  # measured: 110.0 saved vs 109.05 MB estimated
    for peak, estimate in zip(peaks, estimates):
        assert abs(peak / estimate - 1) < 0.15, (peaks, estimates)  # 140.6 vs 142.6 MB, 30.6 vs 33.6 MB


# -----------------------------------------------------------------------------
# compiled stage 3 never holds more than compiled stage 2


def rank0_peak(overrides, world_size, steps):
    """Rank 0 of world_size (the fake process group), built and trained `steps` steps as train.py does, with the
    profiler counting every allocation of torch's CPU allocator from before the model exists. Returns the peak of the
    bytes allocated at once, and the config, model and engine; call it in a fresh process. The same count in every run:
    each collective is done when launched, on this thread, so every buffer is freed at a fixed point and the profiler
    sees each free. Under gloo it did not: its reduce-scatter clones the input for its worker thread, and when that
    thread let go of a clone last, outside the profiler's view, the free went unreported: the tied embedding's 12.9 MB
    clone counted as held from then on (stage 2 of the test below at 172.74 MB, not 159.86, in some runs)."""
    dist.init_process_group('fake', rank=0, world_size=world_size, store=FakeStore())
    cfg = train.parse_config(overrides)
    data = train.load_split(train.data_dir(cfg), 'train')
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    profiler.start()
    model, engine = train.build(cfg, torch.device('cpu'), train.model_args(cfg, train.vocab_size(cfg)))
    for it in range(steps):
        train.train_step(engine, train.train_batches(data, it, cfg, 0, world_size, torch.device('cpu')), 1e-3, nullcontext())
    profiler.stop()
    events = sorted((e.start_ns(), e.nbytes()) for e in profiler.profiler.kineto_results.events() if e.name() == '[memory]')
    dist.destroy_process_group()
    return max(itertools.accumulate(n for _, n in events)), cfg, model, engine


def allocated_peak(i, out_dir, stages, overrides):
    stage = stages[i]  # the spawn's processes run one stage each, side by side (nothing shared but the cores)
    peak = rank0_peak(['config/shakespeare_cpu.py', f'--zero_stage={stage}'] + overrides, 2, 3)[0]
    torch.save(peak, os.path.join(out_dir, f'peak{stage}.pt'))


def test_compiled_stage_3_peaks_no_higher_than_compiled_stage_2(tmp_path):
    """The done-when's memory half, counted rather than timed: config/shakespeare_cpu.py's GPT-2 vocabulary (the
    logits of 8 x 64 tokens are 103 MB in fp32) at rank 0 of 2 ranks, compile=True. Before the chunked loss head stage 3
    ran its head eager, with the whole batch's fp32 logits: it peaked at 443 MB to stage 2's 340 (n_layer=2, n_embd=64)."""
    # a fresh process each: nothing compiled or allocated before the profiler starts
    mp.spawn(allocated_peak, args=(str(tmp_path), (2, 3), ['--compile=True', '--n_layer=2', '--n_embd=64', '--n_head=2']),
             nprocs=2)
    peaks = {stage: torch.load(tmp_path / f'peak{stage}.pt') for stage in (2, 3)}
    assert peaks[3] <= peaks[2], peaks
    # and no vocab-sized fp32 tensor per token left in either: 160 MB each under torch 2.13, 224 MB under 2.11, whose
    # inductor holds ~64 MB more (about one chunk of logits, model.LOSS_CHUNK); the plain head peaked at 340 and 443 MB
    assert peaks[2] < 0.7 * 340e6, peaks


def nodes_feeding_the_blocks_grads(i, out_dir, stages, overrides):
    """Rank 0 of 2 (fake process group), built as train.py builds at stages[i] (the spawn's processes side by side):
    per block, the autograd nodes whose output is one of its params' grads, after a forward of the compiled model."""
    dist.init_process_group('fake', rank=0, world_size=2, store=FakeStore())
    cfg = train.parse_config(['config/shakespeare_cpu.py', f'--zero_stage={stages[i]}'] + overrides)
    model, engine = train.build(cfg, torch.device('cpu'), train.model_args(cfg, train.vocab_size(cfg)))
    x = torch.randint(cfg['block_size'], (2, cfg['block_size']), device='cpu')
    _, loss = engine.module(x, x)
    feeds, seen, todo = {}, set(), [loss.grad_fn]
    while todo:  # every node of the backward graph; an AccumulateGrad's `variable` is the param it writes
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is not None and hasattr(child, 'variable'):
                feeds.setdefault(id(child.variable), set()).add(id(node))
            elif child is not None and child not in seen:
                seen.add(child)
                todo.append(child)
    blocks = [set().union(*(feeds[id(p)] for p in b.parameters())) for b in model.transformer.h]
    torch.save(blocks, os.path.join(out_dir, f'nodes{stages[i]}.pt'))
    dist.destroy_process_group()


def test_compiled_stages_1_and_2_get_each_blocks_grads_from_its_own_backward(tmp_path):
    """train.compile_model: stages 1-3 compile per block. The whole model compiled is one autograd node whose outputs
    are every param's grad, all at once as backward ends: stages 1-2 launched no reduce-scatter before then and held
    every grad at once (measured before, stage 2 of a 6 x 256 GPT: its 26 reduce-scatters at 143-152 ms of a 157 ms
    backward; per block: from 64 ms on)."""
    mp.spawn(nodes_feeding_the_blocks_grads, nprocs=2, args=(
        str(tmp_path), (1, 2), ['--compile=True', '--n_layer=3', '--n_embd=64', '--n_head=2']))
    for stage in (1, 2):
        blocks = torch.load(tmp_path / f'nodes{stage}.pt')
        assert all(blocks) and not any(blocks[i] & blocks[j] for i in range(3) for j in range(i)), (stage, blocks)


# -----------------------------------------------------------------------------
# the profiler


def test_profile_traces_iterations_2_to_4_with_our_named_ranges_and_stops_after_the_fourth(tmp_path):
    log = torchrun(2, f'--out_dir={tmp_path}', '--zero_stage=3', '--profile=True', '--max_iters=6', '--eval_interval=100')
    trace = json.load(open(tmp_path / 'trace_rank0.json'))['traceEvents']
    steps = sorted((e for e in trace if e.get('name', '').startswith('ProfilerStep#')), key=lambda e: e['ts'])
    assert [e['name'] for e in steps] == ['ProfilerStep#1', 'ProfilerStep#2', 'ProfilerStep#3']  # iterations 2, 3, 4
    for prefix in ('reduce_scatter bucket ', 'wait reduce_scatter bucket ', 'all_gather unit ', 'wait all_gather unit '):
        for step in steps:  # every traced step is a whole training iteration
            assert any(re.fullmatch(re.escape(prefix) + r'\d+', e.get('name', '')) and step['ts'] <= e['ts'] <= step['ts'] + step['dur']
                       for e in trace), (prefix, step['name'])
    lines = [line.split(':')[0] for line in log.splitlines() if line.startswith(('iter ', 'profiler trace'))]
    # written and stopped at the end of iteration 4's step (before its log line), not a step later
    assert lines == ['iter 1', 'iter 2', 'iter 3', 'profiler trace of iterations 2-4', 'iter 4', 'iter 5', 'iter 6'], lines


def test_the_profiler_is_stopped_after_the_fourth_iteration(tmp_path):
    # a torch.profiler.schedule without repeat=1 cycles wait/warmup/active to the end of the run (measured on an H100:
    # the whole run 2.6x slower, the trace its last partial cycle)
    profiler = launch.start_profiler(str(tmp_path), 0, torch.device('cpu'))
    running = []
    for iteration in range(1, 8):
        torch.ones(8).sum()
        if profiler:  # as train.py's loop
            profiler = launch.profiler_step(profiler, str(tmp_path), log=lambda *a: None)
        running.append(profiler is not None and torch.autograd._profiler_enabled())
    assert running == [True, True, True, False, False, False, False] and (tmp_path / 'trace_rank0.json').exists()


def test_on_cuda_the_profiler_records_the_gpus_kernels_too(monkeypatch, tmp_path):
    # launch.start_profiler's CUDA branch, torch.profiler.profile stood in for: a GPU run's trace has the kernels
    # (test_gpu.py's test_profile_traces_cuda_kernels... reads a real one), a CPU run's asks for no CUDA activity
    asked = []

    class Profile:
        def __init__(self, activities, **kwargs):
            asked.append(activities)

        def start(self):
            pass
    monkeypatch.setattr(torch.profiler, 'profile', Profile)
    for device in (torch.device('cuda', 1), torch.device('cpu')):
        launch.start_profiler(str(tmp_path), 0, device)
    activity = torch.profiler.ProfilerActivity
    assert asked == [[activity.CPU, activity.CUDA], [activity.CPU]]


# -----------------------------------------------------------------------------
# python bench.py scale


def test_bench_scale_prints_a_row_per_kind_and_counts_what_the_estimator_says():
    cmd = [sys.executable, 'bench.py', 'scale', '--quick', '--world=64'] + [
        f'--set={kv}' for kv in ('device=cpu', 'n_layer=2', 'n_head=2', 'n_embd=32', 'block_size=16', 'batch_size=2')]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=QUIET)
    assert out.returncode == 0, out.stderr[-3000:]
    table = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip('|').split('|')]
                                               for line in out.stdout.splitlines() if line.startswith('| '))}
    assert list(table) == ['kind', 'zero1', 'zero2', 'zero3', 'fsdp2'], out.stdout
    for kind in ('zero1', 'zero2', 'zero3'):
        estimated, measured, ratio = map(float, table[kind][:3])
        assert 0.95 <= ratio <= 1.05 and 0.95 <= measured / estimated <= 1.05, (kind, table[kind])
    assert all(float(cell) > 0 for cell in table['fsdp2'][:5])  # fsdp2 ran; its ratio is the chunking's business


def test_bench_scale_prints_each_kinds_figures_in_its_row_and_says_which_did_not_run(monkeypatch, capsys):
    # the table from made-up results (each kind's subprocess stood in for): measured / estimated, bytes a param, the
    # peak during steps less the runtime against the peak estimate (not the process's peak, the build's included),
    # a kind that died named in its row, and the DDP kinds, which cannot run under the fake group, named as skipped
    import argparse
    import bench_scale

    def result(kind, estimate, measured):
        return dict(kind=kind, psi=1_000_000, estimate=estimate, populations={'params': measured / 2, 'grads': measured / 2},
                    pads=10, transient=2e6, after_step=3e6, runtime=50e6, steps_peak=90e6, process_peak=120e6,
                    step_ms=12.0, build_s=1.5, peak_estimate=20e6, threads=2, links=[], flops_per_token=1.0,
                    peak_flops=None)
    made = {'zero2': result('zero2', 8e6, 10e6), 'zero3': result('zero3', 4e6, 5e6),
            'fsdp2': dict(kind='fsdp2', failed='exit code -9 (killed: out of memory?)')}
    monkeypatch.setattr(bench_scale, 'run_kind', lambda kind, args: made[kind])
    parser = argparse.ArgumentParser()
    parser.add_argument('--config'), parser.add_argument('--set', action='append', default=[]), parser.add_argument('--kinds')
    bench_scale.add_arguments(parser)
    bench_scale.bench_scale(parser.parse_args(['--config=config/shakespeare_cpu.py', '--kinds=ddp,zero2,zero3,fsdp2',
                                               '--world=8', '--set=device=cpu']))
    out = capsys.readouterr().out
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip('|').split('|')]
                                              for line in out.splitlines() if line.startswith('| '))}
    assert list(rows) == ['kind', 'zero2', 'zero3', 'fsdp2'], out
    assert rows['zero2'][:10] == ['8.00', '10.00', '1.2500', '10.000', '3.00', '90', '120', '50', '20', '2.000'], rows
    assert rows['zero3'][:5] == ['4.00', '5.00', '1.2500', '5.000', '3.00'], rows
    assert rows['fsdp2'][0] == 'did not run: exit code -9 (killed: out of memory?)', rows
    assert 'skipped ddp: torch DDP cannot run under the fake process group' in out


# -----------------------------------------------------------------------------
# the peak: the estimate against every byte torch's CPU allocator hands out

PEAK = """
import json, sys, memory, train
from test_memory import rank0_peak
for overrides in json.loads(sys.argv[1]):  # rank 0 of 8, as bench.py scale builds it; one micro-step, two steps
    allocated, cfg, model, engine = rank0_peak(overrides + ['--gradient_accumulation_steps=8'], 8, 2)
    zcfg = train.zero_config(cfg)
    act = memory.activations(cfg['n_layer'], cfg['n_embd'], train.vocab_size(cfg), cfg['batch_size'] * cfg['block_size'], 4,
                             cfg['activation_checkpointing'])
    states = sum(b for _, b in memory.model_states(zcfg.stage, engine.psi, 8, zcfg).values())
    units = memory.unit_sizes(model, model.transformer.h)
    estimate = states + memory.transient_bytes(zcfg.stage, zcfg, *units, engine.psi, 8, act)
    print(json.dumps([allocated, estimate]), flush=True)
"""

PEAK0 = """
import gc, itertools, json, sys, torch, torch.distributed as dist
import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as hooks
import memory, train
def done(process_group, bucket):  # one rank's all-reduce, without gloo (whose worker frees its clone when it will)
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future
hooks.allreduce_hook = done  # zero.DataParallel's hook calls it: the count stays the same in every run
for overrides in json.loads(sys.argv[1]):
    dist.init_process_group('gloo', rank=0, world_size=1, store=dist.HashStore())
    cfg = train.parse_config(overrides)
    data = train.load_split(train.data_dir(cfg), 'train')
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    profiler.start()
    model, engine = train.build(cfg, torch.device('cpu'), train.model_args(cfg, train.vocab_size(cfg)))
    autocast = torch.autocast('cpu', getattr(torch, cfg['dtype']), enabled=cfg['dtype'] != 'float32')
    for it in range(2):
        train.train_step(engine, train.train_batches(data, it, cfg, 0, 1, torch.device('cpu')), 1e-3, autocast)
    profiler.stop()
    events = sorted((e.start_ns(), e.nbytes()) for e in profiler.profiler.kineto_results.events() if e.name() == '[memory]')
    zcfg = train.zero_config(cfg)
    act = memory.activations(cfg['n_layer'], cfg['n_embd'], train.vocab_size(cfg), cfg['batch_size'] * cfg['block_size'],
                             zcfg.param_dtype.itemsize, cfg['activation_checkpointing'])
    states = sum(b for _, b in memory.model_states(0, engine.psi, 1, zcfg).values())
    estimate = states + memory.transient_bytes(0, zcfg, *memory.unit_sizes(model, model.transformer.h), engine.psi, 1, act)
    print(json.dumps([max(itertools.accumulate(n for _, n in events)), estimate]), flush=True)
    dist.destroy_process_group()
    del model, engine, autocast, profiler
    gc.collect()  # the last shape's tensors freed now, not while the next one is profiled (a free counted against it)
"""


def test_stage_0s_peak_estimate_counts_the_casts_of_its_fp32_params_and_a_checkpointed_blocks_fp32_input():
    """Stage 0 (torch DDP) keeps fp32 params and computes under autocast: the forward's bf16 casts of the weights (aΨ)
    and, checkpointed, each block's fp32 input. Before they were counted, the estimate fell short of the bytes
    allocated by 7.8% and 3.9% (bf16, without and with checkpointing): the unsafe side for zero_stage='auto'. Measured
    now: 1.008 and 0.986 of the estimate in bf16, 0.984 and 0.960 in fp32 (the same in every run)."""
    shape = ['config/shakespeare_char.py', '--zero_stage=0', '--n_layer=4', '--n_embd=256', '--n_head=4', '--batch_size=8',
             '--block_size=128', '--device=cpu', '--gradient_accumulation_steps=1']
    shapes = [shape + [f'--dtype={d}', f'--activation_checkpointing={ck}'] for d in ('bfloat16', 'float32') for ck in (False, True)]
    out = subprocess.run([sys.executable, '-c', PEAK0, json.dumps(shapes)], capture_output=True, text=True, env=QUIET,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for overrides, line in zip(shapes, out.stdout.splitlines()):
        allocated, estimate = json.loads(line)
        assert 0.95 <= allocated / estimate <= 1.03, (overrides[-2:], allocated / 1e6, estimate / 1e6)


PEAK_SHAPES = {  # each with a different worst moment of [Note: the peak]
    'head forward: 3 chunks of logits, the root gathered': ['config/shakespeare_cpu.py', '--zero_stage=3', '--n_layer=2',
                                                            '--n_embd=256', '--n_head=4', '--batch_size=8', '--block_size=128'],
    'first block backward: gathered blocks, grads and buffer': ['config/shakespeare_char.py', '--zero_stage=3', '--n_layer=3',
                                                                '--n_embd=256', '--n_head=4', '--batch_size=1', '--block_size=64'],
    'stage 2, checkpointed: a recomputed block': ['config/shakespeare_char.py', '--zero_stage=2', '--n_layer=4', '--n_embd=128',
                                                  '--n_head=4', '--batch_size=8', '--block_size=128', '--activation_checkpointing=True'],
    'stage 3, prefetch 2: the head of a short batch': ['config/shakespeare_cpu.py', '--zero_stage=3', '--n_layer=2',
                                                               '--n_embd=128', '--n_head=2', '--batch_size=1', '--block_size=32', '--prefetch=2'],
    'stage 3, 2 blocks a unit: gathered units, grads and buffer': [
        'config/shakespeare_char.py', '--zero_stage=3', '--n_layer=4', '--n_embd=256', '--n_head=4', '--batch_size=1',
        '--block_size=64', '--blocks_per_unit=2'],
}


def test_the_peak_estimate_is_within_10_percent_of_the_bytes_allocated_at_rank_0_of_8():
    """Every tensor byte of a fresh process (the profiler's CPU memory events, from before the model is built through
    two steps), at its peak, against model states + transient_bytes: shapes whose peaks come at different moments."""
    out = subprocess.run([sys.executable, '-c', PEAK, json.dumps(list(PEAK_SHAPES.values()))], capture_output=True, text=True,
                         env=QUIET, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for name, line in zip(PEAK_SHAPES, out.stdout.splitlines()):
        allocated, estimate = json.loads(line)
        assert 0.9 <= allocated / estimate <= 1.1, (name, allocated / 1e6, estimate / 1e6)
