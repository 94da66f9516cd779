"""
model.py as tests: GPT-2's shapes, tied weights, init and loss, the chunked loss head against the plain one,
generation, the weight-decay split, and the FLOPs count behind MFU. (Nothing of sharding: model.py knows none.)
"""
import math
import subprocess
import sys

import pytest
import torch

import model as model_module
from model import GPT, GPTConfig, peak_flops
from test_zero import TINY, tiny_model


def test_model_forward_shapes_and_tied_weights_share_storage():
    model = GPT(GPTConfig(**TINY))
    assert model.transformer.wte.weight is model.lm_head.weight
    assert model.transformer.wte.weight.data_ptr() == model.lm_head.weight.data_ptr()
    names = [n for n, _ in model.named_parameters()]
    assert 'lm_head.weight' not in names and 'transformer.wte.weight' in names  # listed once
    x = torch.randint(97, (2, 16))
    logits, loss = model(x, x)
    assert logits is None and loss.shape == ()  # training never materializes the logits: [Note: chunked loss head]
    logits, loss = model(x)
    assert logits.shape == (2, 1, 97) and loss is None
    assert model.generate(x[:, :4], max_new_tokens=20).shape == (2, 24)  # grows past block_size


def plain_head_loss(model, idx, targets):
    """The head as it was: the whole batch's logits, then F.cross_entropy on them in fp32."""
    x = model.transformer.drop(model.transformer.wte(idx) + model.transformer.wpe(torch.arange(idx.size(1))))
    for block in model.transformer.h:
        x = block(x)
    logits = model.lm_head(model.transformer.ln_f(x))
    return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


@pytest.mark.parametrize('chunk', [1, 2**30])  # LOSS_CHUNK: 64-row chunks (4 of them, the last short), or one chunk
def test_chunked_loss_head_equals_the_plain_head_loss_and_grads(monkeypatch, chunk):
    monkeypatch.setattr(model_module, 'LOSS_CHUNK', chunk)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**TINY, 'block_size': 50}))
    idx, targets = torch.randint(97, (2, 4, 50))  # 200 rows
    targets[0, :7] = -1  # ignored positions
    grads = []
    for loss_fn in (lambda: model(idx, targets)[1], lambda: plain_head_loss(model, idx, targets)):
        model.zero_grad()
        loss = loss_fn()
        (loss / 3).backward()  # the head's backward scales by the incoming grad
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss, got), (ref_loss, ref) = grads
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-8, msg=name)
    with torch.no_grad():  # evaluation: the loss alone, no grads computed
        torch.testing.assert_close(model(idx, targets)[1], ref_loss, rtol=1e-6, atol=0)


def test_the_heads_loop_dispatches_15_ops_a_chunk():
    """[Note: chunked loss head]: eager on a GPU every op in the chunk loop is a launch the host makes once a chunk, and
    the host set the pace of an eager GPT-2 micro-step (assets/gpu_h200.md, "The sixth GPU pass"). Counted as torch
    dispatches them, under bf16 autocast as training runs: each chunk more costs 15 ops (14 kernels and the weight
    grad's transpose, a view); what is per row is made once for the batch. The loop before took 32 a chunk."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(256, 16, requires_grad=True), torch.randn(97, 16, requires_grad=True)
    targets = torch.randint(97, (256,))
    targets[:5] = -1
    counts = []
    for rows in (128, 32):  # 2 chunks, then 8
        Count.n = 0
        with torch.autocast('cpu', dtype=torch.bfloat16), Count():
            model_module.linear_cross_entropy(x, w, targets, rows)
        counts.append(Count.n)
    assert (counts[1] - counts[0]) / 6 == 15, counts


def test_init_loss_is_about_ln_vocab():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=50304))
    x, y = torch.randint(50304, (2, 4, 32))
    _, loss = model(x, y)  # targets independent of inputs (tied weights favour repeating the input)
    assert abs(loss.item() - math.log(50304)) < 0.1  # 10.83 at init: near-uniform predictions


def test_weight_decay_split_decays_matrices_not_biases_or_norms():
    model = GPT(GPTConfig(**TINY))
    decay, no_decay = model.param_groups(0.1)
    assert all(p.dim() >= 2 for p in decay['params']) and decay['weight_decay'] == 0.1
    assert all(p.dim() == 1 for p in no_decay['params']) and no_decay['weight_decay'] == 0.0
    assert len(decay['params']) + len(no_decay['params']) == len(list(model.parameters()))


def test_mfu_is_none_without_a_known_peak():
    model = GPT(GPTConfig(**TINY))
    assert model.estimate_mfu(1e5, None) is None
    assert 0 < model.estimate_mfu(1e5, 1e12) < 1


def test_flops_per_token_is_6n_plus_the_attention_term_with_n_the_params_less_the_position_embedding():
    # MFU's numerator (train.py's log, bench_scale's table): N counts the tied embedding once and leaves out wpe
    # (nanoGPT's get_num_params), plus 12 * n_layer * n_embd * block_size for the attention scores and values
    model = GPT(GPTConfig(**TINY))
    L, C, V, T = TINY['n_layer'], TINY['n_embd'], TINY['vocab_size'], TINY['block_size']
    per_block = 2 * 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C)  # 2 LNs, attn, MLP
    n = V * C + L * per_block + 2 * C  # wte (= lm_head), the blocks, ln_f
    assert model.get_num_params() == n and model.get_num_params(non_embedding=False) == n + T * C
    assert model.flops_per_token() == 6 * n + 12 * L * C * T
    assert model.estimate_mfu(1e5, 1e12) == pytest.approx((6 * n + 12 * L * C * T) * 1e5 / 1e12, rel=1e-12)


def test_generate_conditions_on_the_last_block_size_tokens_and_samples_only_the_top_k():
    # past block_size the context is cropped to its last block_size tokens (not its first); top_k keeps the k most
    # likely tokens (not 1, not all): with a fixed seed, generating from a long context equals generating from its
    # last block_size tokens, every sample lies in the top k of the logits, and 400 samples at init (near-uniform)
    # take more than one of them
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).eval()
    T = TINY['block_size']
    idx = torch.randint(97, (4, T + 7))
    torch.manual_seed(1)
    long = model.generate(idx, max_new_tokens=5)
    torch.manual_seed(1)
    short = model.generate(idx[:, -T:], max_new_tokens=5)
    assert torch.equal(long[:, -5:], short[:, -5:]) and torch.equal(long[:, :-5], idx)
    context = idx[:1, -T:].expand(400, T)
    with torch.no_grad():
        top = set(torch.topk(model(context[:1])[0][0, -1], 5).indices.tolist())
    torch.manual_seed(2)
    drawn = set(model.generate(context, max_new_tokens=1, top_k=5)[:, -1].tolist())
    assert drawn <= top and len(drawn) > 1, (drawn, top)


def test_generate_at_a_tiny_temperature_decodes_greedily():
    # before: logits / 1e-45 overflowed to inf, and softmax's inf - inf made the probabilities nan (sample.py's
    # --temperature=1e-45 died in torch.multinomial); less the max first, the rest go to -inf: the top token, as top_k=1
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).eval()
    idx = torch.randint(97, (4, 3))
    for tiny in (1e-45, 1e-300):  # 1e-300 is 0 in fp32: the division's floor, fp32's smallest normal, takes its place
        assert torch.equal(model.generate(idx, max_new_tokens=5, temperature=tiny), model.generate(idx, 5, top_k=1))


@pytest.mark.parametrize('name, flops', [('NVIDIA H100 80GB HBM3', 989e12), ('NVIDIA H100 PCIe', 756e12),
                                         ('NVIDIA H100 NVL', 835e12), ('NVIDIA H200', 989e12),
                                         ('NVIDIA A100-SXM4-80GB', 312e12), ('NVIDIA H800', 989e12), ('Tesla T4', None),
                                         ('NVIDIA H200 NVL', 835e12), ('NVIDIA H800 PCIe', 756e12)])
def test_peak_flops_by_gpu_name(monkeypatch, name, flops):
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device=None: name)
    assert peak_flops(torch.device('cuda', 0)) == flops
    assert peak_flops(torch.device('cpu')) is None


def test_init_param_fills_any_slice_on_the_tensors_device_whatever_the_default_device():
    plain = tiny_model(0)
    for name, p in plain.named_parameters():
        for default in ('cpu', 'meta'):
            with torch.device(default):
                piece = torch.empty(p.numel() - 3, device='cpu')
                plain.init_param(name, piece, start=3)
            assert torch.equal(piece, p.detach().reshape(-1)[3:]), (name, default)


def test_init_is_gpt2s_normal_with_the_residual_projections_scaled_by_one_over_sqrt_2_n_layer():
    # [Note: counter-based init] draws its own values, so equality with a plain GPT (the tests above) cannot tell a
    # wrong distribution: here each >= 2-D param is N(0, 0.02), the residual projections (attn.c_proj and mlp.c_proj)
    # N(0, 0.02 / sqrt(2 * n_layer)), the LayerNorm gains 1 and the biases 0. Pooled over the ~40k elements of the
    # tiny model (standardized by their own std), the moments and the normal's 1- and 2-sigma masses hold within ~4
    # standard errors; one per-param std within 10% (a wrong residual scale is 41% off at 3 layers)
    model = tiny_model(0)
    zs = []
    for name, p in model.named_parameters():
        p = p.detach().double()
        if p.dim() == 1:
            assert torch.equal(p, torch.full_like(p, 0.0 if name.endswith('bias') else 1.0)), name
            continue
        std = 0.02 / math.sqrt(2 * TINY['n_layer']) if name.endswith('c_proj.weight') else 0.02
        assert abs(p.std().item() / std - 1) < 0.1, (name, p.std().item(), std)
        zs.append(p.reshape(-1) / std)
    z = torch.cat(zs)
    assert z.numel() > 30_000
    assert abs(z.mean().item()) < 0.02 and abs(z.std().item() - 1) < 0.015, (z.mean().item(), z.std().item())
    within1, within2 = ((z.abs() < k).double().mean().item() for k in (1, 2))
    assert abs(within1 - 0.6827) < 0.01 and abs(within2 - 0.9545) < 0.005, (within1, within2)


def test_building_the_model_on_the_meta_device_draws_nothing_and_imports_no_compiler():
    # stages 1-3 build on the meta device: nn.Embedding's own normal_ there runs a Python decomposition that imports
    # torch._dynamo, 1.3-1.9 s of every rank's start on this CPU (more than the rest of a small run), for values that
    # init_param overwrites. model.Embedding skips it; compile=True still imports it, when it compiles.
    code = ("import sys, torch, model\n"
            "with torch.device('meta'):\n"
            "    m = model.GPT(model.GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=16))\n"
            "print(all(p.is_meta for p in m.parameters()), 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ['True', 'False'], out.stderr[-2000:]
