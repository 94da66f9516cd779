"""
Stage 3's units (fsdp_lite.py) in the oracle harness of test_zero.py: prefetch and its order, resharding and what a
unit really frees, blocks grouped into units ([Note: blocks per unit]), the last unit kept into backward ([Note: the
last unit stays gathered]), and the step after a forward that no backward followed. Their jobs run in test_zero's
spawn of each world size (MORE_JOBS); the parity of stage 3 with DDP and FSDP2 stays in test_zero.py.
"""
import math

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_lite
import kernels
import zero
from test_zero import MORE_JOBS, STEPS, T, TINY, assert_same_run, get, make_engine, tiny_model

for world_size in (2, 3):  # TINY's 3 blocks as units of 2 + 1 and of 3
    MORE_JOBS[world_size] += [dict(kind='zero3', accum=2 * world_size, blocks_per_unit=k, trace=True) for k in (2, 3)]


@pytest.mark.parametrize('world_size', [2, 3])
def test_zero3_prefetch_depth_and_reshard_after_forward_do_not_change_numbers(world_size):
    accum = 2 * world_size
    base = get(world_size, kind='zero3', accum=accum)
    for prefetch in (0, 2):
        for reshard in (True, False):
            other = get(world_size, kind='zero3', accum=accum, prefetch=prefetch, reshard_after_forward=reshard)
            assert_same_run(other, base, rtol=0, atol=0)  # same math, same order: bit-identical
            if reshard:
                assert other['peak_live'] <= prefetch + 1  # unsharded block units at once
    assert base['peak_live'] <= 2


@pytest.mark.parametrize('world_size', [2, 3])
def test_zero3_with_blocks_grouped_into_units_matches_ddp_in_fewer_collectives_of_the_same_bytes(world_size):
    """fsdp_lite [Note: blocks per unit]: TINY's 3 blocks as units of 2 + 1, and as one unit of 3. The run is DDP's,
    the elements reduce-scattered those of a unit per block (less pads), and each micro-step all-gathers every unit in
    forward and every block unit but the last again in backward (reshard_after_forward): 2 * 2 and 2 * 1 all-gathers,
    not 2 * 3, as train.py's startup line (fsdp_lite.describe) says."""
    accum = 2 * world_size  # 2 micro-steps per rank
    ddp, per_block = get(world_size, kind='ddp', accum=accum), get(world_size, kind='zero3', accum=accum)
    described = {2: 'stage 3: 2 units (2 + 1 blocks) + the root (blocks_per_unit=2), prefetch 1: 3 all-gathers and 3 '
                    "reduce-scatters a micro-step, + the root's all-gather once a step",
                 3: 'stage 3: 1 unit of 3 blocks + the root (blocks_per_unit=3), prefetch 1: 1 all-gather and 2 '
                    "reduce-scatters a micro-step, + the root's all-gather once a step"}
    for k, units in ((2, 2), (3, 1)):
        run = get(world_size, kind='zero3', accum=accum, blocks_per_unit=k, trace=True)
        assert_same_run(run, ddp)
        assert run['n_buckets'] == units + 1  # + the root's
        # reduce-scattered: the same elements, less the pads of fewer units (~0.1%; a block missing would be ~30%);
        # all-gathered: every block unit in forward, all but the last again in backward, the root once a step (as
        # counted for k=1 in test_counted_communication_is_2psi_for_ddp_and_zero12_and_3psi_for_zero3)
        numel = per_block['comm']['reduce_scatter']
        assert 0.99 * numel <= run['comm']['reduce_scatter'] <= numel, (run['comm'], numel)
        P, root, last = run['padded'], run['root_padded'], run['last_padded']
        assert run['comm']['all_gather'] == STEPS * (2 * (2 * P - 2 * root - last) + root) + last
        assert sum(event == 'gather' for event, _ in run['events']) == 2 * (2 * units) - 1  # the last step's 2 micro-steps
        assert run['describe'] == described[k]


MORE_JOBS[2] += [dict(kind='zero3', accum=4, blocks_per_unit=2, checkpointing=True),
                 dict(kind='zero3', accum=4, blocks_per_unit=2, prefetch=2, reshard_after_forward=False)]


def test_zero3_with_two_blocks_a_unit_checkpointed_or_prefetching_two_units_matches_ddp():
    """A unit's first block is recomputed (activation checkpointing) while the unit is gathered for backward; two
    units in flight ahead, kept from forward to backward."""
    ddp = get(2, kind='ddp', accum=4)
    assert_same_run(get(2, kind='zero3', accum=4, blocks_per_unit=2, checkpointing=True), ddp)
    assert_same_run(get(2, kind='zero3', accum=4, blocks_per_unit=2, prefetch=2, reshard_after_forward=False), ddp)


def test_zero3_steps_safely_after_a_forward_that_no_backward_followed():
    """The root and the last unit stay gathered after a forward with grad ([Note: the last unit stays gathered]), and
    with fp32 compute each gathered unit has freed its shard's storage: a step must put the shards back first (before,
    the fused step wrote into freed storage: a crash). At lr 0 the step changes no weight: the shards come back exact."""
    dist.init_process_group('fake', rank=0, world_size=2, store=FakeStore())
    try:
        model, x = tiny_model(0), torch.randint(TINY['vocab_size'], (2, T))
        engine = make_engine('zero3', model, 1.0)
        engine.backward(model(x, x)[1])  # the forward order recorded
        engine.step(1e-3)
        before = [u.sharded_param.clone() for u in engine.units]
        model(x, x)  # no backward
        assert sum(u.state is fsdp_lite.State.UNSHARDED for u in engine.units) == 2  # the root and the last block
        engine.step(0.0)
        assert all(u.state is fsdp_lite.State.SHARDED and u.sharded_param.untyped_storage().nbytes() == u.shard_nbytes
                   for u in engine.units)
        assert all(torch.equal(a, u.sharded_param) for a, u in zip(before, engine.units))
    finally:
        dist.destroy_process_group()


def test_zero3_keeps_the_root_gathered_between_micro_steps_and_the_step_reshards_it():
    """[Note: the root stays gathered through a step]: after each micro-step's backward every block unit is sharded
    and the root is not (its shard still lent); the root is gathered once a step, counted in elements; the step puts
    every shard back, the root's as it was gathered (lr 0), and the next step gathers the root again."""
    dist.init_process_group('fake', rank=0, world_size=2, store=FakeStore())
    try:
        model, x = tiny_model(0), torch.randint(TINY['vocab_size'], (2, T))
        engine = make_engine('zero3', model, 1.0)
        root = next(u for u in engine.units if u.is_root)
        blocks = sum(u.bucket.padded_numel for u in engine.units if not u.is_root)
        last = engine.buckets[0].padded_numel  # the last block unit of forward: kept into backward once it is known
        for step in range(2):
            before = engine.comm.numel.get('all_gather', 0)
            for _ in range(3):
                engine.backward(model(x, x)[1])
                assert root.state is fsdp_lite.State.UNSHARDED and root.sharded_param.untyped_storage().nbytes() == 0
                assert all(u.state is fsdp_lite.State.SHARDED for u in engine.units if not u.is_root)
            first = last if step == 0 else 0  # the run's first forward cannot know its last block: regathered once
            assert engine.comm.numel['all_gather'] - before == root.bucket.padded_numel + 3 * (2 * blocks - last) + first
            gathered = root.bucket.shard(root.unsharded_param).clone()
            engine.step(0.0)
            assert all(u.state is fsdp_lite.State.SHARDED and u.sharded_param.untyped_storage().nbytes() == u.shard_nbytes
                       for u in engine.units)
            assert torch.equal(root.sharded_param, gathered)
    finally:
        dist.destroy_process_group()


def test_zero3_with_bf16_compute_rounds_the_master_into_its_row_and_gathers_in_place():
    """[Note: a cast per gather]: under bf16 compute with an fp32 master, a unit's all-gather input is its own row of
    the unsharded param, holding the master's bf16 rounding (kernels.cast_param), and the rank's row of what the
    gather wrote is exactly that: no temporary, no copy. At rank 1 of 2 (the fake group copies the input row)."""
    dist.init_process_group('fake', rank=1, world_size=2, store=FakeStore())
    try:
        model, x = tiny_model(0), torch.randint(TINY['vocab_size'], (2, T))
        engine = make_engine('zero3', model, 1.0, param_dtype=torch.bfloat16)
        seen = []
        for unit in engine.units:
            def all_gather(out, inp, comm=unit.comm, **kw):
                seen.append(inp.data_ptr() == out.view(2, -1)[1].data_ptr())  # rank 1's row
                return type(comm).all_gather(comm, out, inp, **kw)
            unit.comm = type('Spy', (), {'all_gather': staticmethod(all_gather)})()
        engine.backward(model(x, x)[1])
        assert len(seen) >= len(engine.units) and all(seen), seen
        for unit in engine.units:
            assert not unit.lends_shard and unit.unsharded_param.dtype == torch.bfloat16
            unit.unshard(), unit.wait_for_unshard()
            rounded = kernels.cast_param(unit.sharded_param, torch.bfloat16)  # the torch ops
            assert torch.equal(unit.bucket.shard(unit.unsharded_param).view(torch.int16), rounded.view(torch.int16))
    finally:
        dist.destroy_process_group()


def test_zero3_built_on_meta_trains_when_the_gathers_cast_takes_the_torch_ops(monkeypatch):
    """The cast into the unsharded param's row must not bump the version counter the params share with it (meta init
    swaps them in): a unit re-gathered before backward would fail it ("modified by an inplace operation"). The CPU
    library writes raw memory, so only the torch ops' path shows it: fp16 compute, and bf16 where the device's
    library does not build (a GPU machine without nvcc). That path equals the library's bit for bit."""
    def run(dtype, library):
        dist.init_process_group('fake', rank=1, world_size=2, store=FakeStore())
        try:
            if not library:
                monkeypatch.setitem(kernels._LIBRARIES, 'cpu', RuntimeError('no compiler (this test)'))
            model = tiny_model(0, meta=True)  # as train.py builds stages 1-3
            engine = zero.build_engine(model, zero.ZeroConfig(stage=3, param_dtype=dtype),
                                       units=list(model.transformer.h), device=torch.device('cpu'))
            x, out = torch.randint(TINY['vocab_size'], (2, T), generator=torch.Generator().manual_seed(0)), []
            for _ in range(2):
                with torch.autocast('cpu', dtype):
                    loss = model(x, x)[1]
                engine.backward(loss)
                out += [loss.item(), engine.step(1e-3)]
            return out
        finally:
            monkeypatch.undo()
            dist.destroy_process_group()
    assert run(torch.bfloat16, library=False) == run(torch.bfloat16, library=True)
    fp16 = run(torch.float16, library=True)  # its losses; the grad norms are inf while the loss scale comes down
    assert all(math.isfinite(loss) for loss in fp16[::2]), fp16


def test_zero3_blocks_grouped_out_of_forward_order_stop_the_first_forward_with_one_line():
    """fsdp_lite [Note: blocks per unit]: units are cut from the list of blocks as given; listed backwards, a unit's
    inner block would run on a sharded (freed) buffer. After a first forward in order the checks are gone."""
    dist.init_process_group('fake', rank=0, world_size=2, store=FakeStore())
    try:
        x = torch.randint(TINY['vocab_size'], (2, T))
        for units, ok in ((lambda h: h[::-1], False), (lambda h: h, True)):
            model = tiny_model(0)
            cfg = zero.ZeroConfig(stage=3, param_dtype=torch.float32, blocks_per_unit=2)
            engine = zero.build_engine(model, cfg, units=units(list(model.transformer.h)), device=torch.device('cpu'))
            if not ok:
                with pytest.raises(RuntimeError, match='blocks_per_unit > 1 needs the blocks listed in forward order'):
                    model(x, x)
                continue
            for _ in range(2):
                engine.backward(model(x, x)[1])
            assert all(u.checks == [] for u in engine.units)
    finally:
        dist.destroy_process_group()


MORE_JOBS[2] += [dict(kind='zero3', accum=4, prefetch=d, trace=True) for d in (1, 2)]


@pytest.mark.parametrize('prefetch', [1, 2])
def test_zero3_prefetch_launches_the_next_units_all_gathers_before_computing_and_before_waiting(prefetch):
    """With prefetch depth d: in forward, the all-gathers of the next d units are launched before unit i's
    computation starts and before the wait on unit i's own all-gather; in backward, the mirror."""
    events = get(2, kind='zero3', accum=4, prefetch=prefetch, trace=True)['events']  # the last step's
    root = TINY['n_layer']  # the last bucket: the root unit
    order = [i for e, i in events if e == 'forward' and i != root][:TINY['n_layer']]  # the first micro-step's blocks
    # each phase's own gathers: backward's begin after the last block's forward (counting forward's, a check of
    # backward prefetch passed with none at all)
    first_backward = next(j for j, (e, _) in enumerate(events) if e == 'backward')
    start = {'forward': 0, 'backward': max(j for j, (e, _) in enumerate(events[:first_backward]) if e == 'forward') + 1}
    for phase, units in (('forward', order), ('backward', order[::-1])):
        for k, unit in enumerate(units):
            compute = events.index((phase, unit))
            wait = max(j for j in range(start[phase], compute) if events[j] == ('wait', unit))
            for ahead in units[k + 1:k + 1 + prefetch]:
                assert ('gather', ahead) in events[start[phase]:wait], (phase, unit, ahead)


@pytest.mark.parametrize('prefetch', [1, 2])
def test_zero3_the_roots_forward_prefetches_the_first_blocks_before_it_computes(prefetch):
    """The root's forward pre-hook launches the first d block units' all-gathers (d = prefetch) before its own wait and
    the embedding: the first block's gather runs under the root's work instead of being launched at its own forward,
    behind the second's on the link, and waited at once. Every micro-step: the root stays gathered through a step, its
    pre-hook still prefetches."""
    events = get(2, kind='zero3', accum=4, prefetch=prefetch, trace=True)['events']  # the last step's 2 micro-steps
    root = TINY['n_layer']
    order = [i for e, i in events if e == 'forward' and i != root][:TINY['n_layer']]
    starts = [j for j, event in enumerate(events) if event == ('forward', root)]
    assert len(starts) == 2, events
    for start in starts:  # this micro-step's forward gathers: after the last backward event before it
        begin = max((j for j in range(start) if events[j][0] == 'backward'), default=-1) + 1
        for unit in order[:prefetch]:
            assert ('gather', unit) in events[begin:start], (prefetch, unit, events[begin:start])


@pytest.mark.parametrize('world_size', [2, 3])
def test_zero3_really_frees_unsharded_params(world_size):
    """The storage, not just the state: at most prefetch + 1 block units hold their unsharded bytes at any
    block's forward, and after the step nothing does (the root included: it stays gathered from the step's first
    forward to the step, fsdp_lite [Note: the root stays gathered through a step])."""
    for prefetch in (0, 1, 2):
        r = get(world_size, kind='zero3', accum=2 * world_size,
                **({} if prefetch == 1 else dict(prefetch=prefetch, reshard_after_forward=True)))
        assert r['peak_resident'] <= prefetch + 1, (prefetch, r['peak_resident'])
        assert r['resident_after'] == 0, r['resident_after']


@pytest.mark.parametrize('world_size', [2, 3])
def test_zero3_a_gathered_unit_does_not_also_hold_its_shard(world_size):
    """[Note: a gathered unit holds its shard once]: with fp32 compute the all-gather input is the sharded param
    itself, and a gathered unit's own shard then lives only in its unsharded param, the root's too (the runs still
    equal DDP's and FSDP2's: the parity tests; test_precision.py covers the bf16 modes)."""
    r = get(world_size, kind='zero3', accum=2 * world_size)
    assert all(r['lends']) and r['held_twice'] == 0, (r['lends'], r['held_twice'])
    assert r['peak_resident'] >= 1  # the samples did see gathered units
