"""
What only a GPU can check. python -m pytest -q test_gpu.py (skipped without CUDA).
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="test_gpu.py needs CUDA: run it on a GPU machine")

# --- issue 20: a simulated link on the communication stream (comm.py, [Note: simulated link])


@pytest.fixture
def fake_world():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    yield lambda world_size: dist.init_process_group('fake', rank=0, world_size=world_size, store=FakeStore())
    if dist.is_initialized():
        dist.destroy_process_group()


def test_simulated_link_on_cuda_queues_on_a_side_stream_and_orders_the_current_stream(fake_world):
    """The host is not blocked by a launch or a wait; the current stream is, by the ring's time, and two
    collectives queue one after the other (FIFO). Bounds from below only (a spin is never shorter than its
    cycles, up to the clock-rate measurement), plus a generous one on the host's launch."""
    import time
    import comm
    fake_world(8)
    device = torch.device('cuda', 0)
    c = comm.Comm(device=device)
    link = comm.Link(bandwidth=1e15, latency=50e-3 / 7)  # 50 ms per collective at 8 ranks
    c.use_link(link)
    out, inp = torch.empty(8 * 1024, device=device), torch.ones(1024, device=device)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    first = c.all_gather(out, inp, async_op=True)
    second = c.reduce_scatter(inp, out, async_op=True)
    first.wait()
    second.wait()
    host = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    assert host < 0.05, host  # launching and waiting took less than one collective: the host was not blocked
    assert start.elapsed_time(end) >= 0.9 * 100, start.elapsed_time(end)  # ms: both, one after the other
    assert link.busy == {'all_gather': pytest.approx(0.05), 'reduce_scatter': pytest.approx(0.05)}
    assert torch.equal(out.view(8, -1)[3], torch.ones(1024, device=device))  # the fake group's fill still happens


def test_bench_scale_with_a_link_runs_on_cuda():
    import subprocess
    import sys
    cmd = [sys.executable, 'bench.py', 'scale', '--quick', '--world=64', '--link=ib400', '--kinds=zero2,zero3',
           '--set=device=cuda', '--set=dtype=bfloat16'] + [
        f'--set={kv}' for kv in ('n_layer=2', 'n_head=2', 'n_embd=64', 'block_size=32', 'batch_size=2')]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [[c.strip() for c in line.strip('|').split('|')] for line in out.stdout.splitlines() if line.startswith('| ')]
    assert [r[0] for r in rows if len(r) > 1 and r[1] == 'ib400'] == ['zero2', 'zero3'], out.stdout
