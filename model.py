"""
A GPT-2 language model, nanoGPT-compatible (same config names, same parameter names, tied embeddings).

nanozero's ZeRO code never looks inside this file: it sees a list of named parameters, the list of
transformer blocks (stage 3's units) and `init_param(name, tensor, start)`, which fills any tensor with a slice of a
param's initial value (stages 1-3 build the model on the meta device and each rank draws only its own shard). Anything
a user swaps in for this model must only keep that contract.
"""
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for faster matmuls
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linears and LayerNorms, like GPT-2; False is a bit better and faster


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (torch's nn.LayerNorm cannot turn the bias off alone)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class Embedding(nn.Embedding):
    """nn.Embedding without torch's own init: init_param draws every param ([Note: counter-based init]). torch's
    normal_ would be drawn only to be overwritten, and on the meta device its Python decomposition imports
    torch._dynamo: 1.3-1.9 s of every process's start here, for nothing."""

    def reset_parameters(self):
        pass


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be divisible by n_head"
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()  # batch, sequence length, embedding dim
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads: (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LN transformer block: the unit that ZeRO-3 gathers and frees as a whole."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


# -----------------------------------------------------------------------------
# [Note: counter-based init] Initial values without a random generator's state: element i of a param is
# N(0, 1) by Box-Muller from two 32-bit hashes of (seed, param name, i), so any rank can draw any slice of
# any param alone (its shard), on any device, and get the values a plain GPT draws. The hash is the 32-bit
# integer mixer of the stochastic-rounding hash (kernels.py, Chris Wellons' lowbias32), in int64 torch ops:
# exact on every device. Box-Muller's log, sqrt and cos run in float64, and the value is rounded to float32
# once: CPU and CUDA float64 libraries agree to ~1 ulp (2^-52), so a value could round to a different float32
# only within ~2^-52 of a rounding boundary, about 1 element in 2^28 (test_gpu.py compares the devices).

INIT_CHUNK = 1 << 16  # elements per chunk of init_param: 512 KB of int64 per temporary


def _mix32_(x, tmp):
    """lowbias32 (kernels._lowbias32) in place on int64 x < 2^32: x * c mod 2^32 as two products < 2^48."""
    for c, shift in ((0x7FEB352D, 16), (0x846CA68B, 15)):
        x ^= torch.bitwise_right_shift(x, shift, out=tmp)
        torch.mul(x, c >> 16, out=tmp).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
        x.mul_(c & 0xFFFF).add_(tmp).bitwise_and_(0xFFFFFFFF)
    x ^= torch.bitwise_right_shift(x, 16, out=tmp)
    return x


def counter_normal(start, n, keys, device):
    """N(0, 1) values of elements [start, start + n) of the stream keyed by keys (two 32-bit ints), float64."""
    index = torch.arange(start, start + n, dtype=torch.int64, device=device)
    tmp = torch.empty_like(index)
    h = _mix32_(index, tmp)
    a = _mix32_(h ^ keys[0], tmp)  # (n,) uniform 32-bit ints, two independent streams
    b = _mix32_(h.bitwise_xor_(keys[1]), tmp)
    u1 = a.double().add_(1.0).mul_(2.0**-32)  # (0, 1]: log(u1) is finite
    u2 = b.double().mul_(2.0**-32)  # [0, 1)
    return u1.log_().mul_(-2.0).sqrt_().mul_(u2.mul_(2 * math.pi).cos_())


class GPT(nn.Module):

    def __init__(self, config, seed=0):
        super().__init__()
        assert config.vocab_size is not None and config.block_size is not None
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=Embedding(config.vocab_size, config.n_embd),
            wpe=Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()
        self.seed = seed
        for name, p in self.named_parameters():
            if not p.is_meta:  # on the meta device there is nothing to fill: ZeRO-3 calls init_param per unit
                self.init_param(name, p.data)

    def tie_weights(self):
        """Weight tying: one Parameter serves as the input embedding and the output projection. named_parameters()
        lists it once (as transformer.wte.weight); autograd sums both uses into one .grad, and the ZeRO layout must
        therefore hold it exactly once. Tie again after a move that makes new Parameters (to_empty from meta)."""
        self.transformer.wte.weight = self.lm_head.weight

    def init_param(self, name, tensor, start=0):
        """Fill `tensor` with elements [start, start + tensor.numel()) of parameter `name`'s initial value, flattened
        (start=0 and the param's shape: the whole param). [Note: counter-based init] Each element's value is a function
        of (seed, name, its index in the param) alone, drawn on tensor's device: a ZeRO rank draws only the elements of
        its own shard, and they equal, bit for bit, those of a plain GPT(config) at any world size, stage or layout."""
        shape = self.get_parameter(name).shape
        if len(shape) == 1:  # LayerNorm gains 1, biases 0
            tensor.fill_(0.0 if name.endswith('bias') else 1.0)
            return
        flat = tensor.reshape(-1)  # a view of tensor, unless tensor is not contiguous (then copied back below)
        # GPT-2: N(0, 0.02); residual projections scaled by 1/sqrt(2 * n_layer)
        std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith('c_proj.weight') else 0.02
        assert math.prod(shape) < 2**32, f"{name}: the init hash indexes a param's elements with 32 bits"
        keys = [zlib.crc32(f'{self.seed}/{name}/{k}'.encode()) for k in (1, 2)]
        for lo in range(0, flat.numel(), INIT_CHUNK):  # chunks: the int64 temporaries stay in cache
            out = flat[lo:lo + INIT_CHUNK]
            out.copy_(counter_normal(start + lo, out.numel(), keys, out.device).mul_(std))  # rounded once, to out's dtype
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))

    def get_num_params(self, non_embedding=True):
        """Parameter count. The position embedding is subtracted by default (as in nanoGPT); the token
        embedding is not, because it is also the lm_head weight and does real work in the last layer."""
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def forward(self, idx, targets=None):
        """With targets: (None, the mean cross-entropy), computed by head() without ever holding the logits of the
        whole batch. Without: (the logits of the last position (B, 1, vocab_size), None), for generation."""
        B, T = idx.size()
        assert T <= self.config.block_size, f"sequence of length {T} > block_size {self.config.block_size}"
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        if targets is not None:
            return None, self.head(x, targets)
        return self.lm_head(self.transformer.ln_f(x[:, [-1], :])), None  # inference: the last position only

    def head(self, x, targets):
        """ln_f, the tied lm_head and the mean cross-entropy over the targets (-1: ignored), in chunks of rows:
        [Note: chunked loss head]. A method of its own so that a trainer can compile it apart from the rest."""
        x = self.transformer.ln_f(x)
        rows = loss_chunk_rows(self.config.vocab_size)
        return linear_cross_entropy(x.view(-1, x.size(-1)), self.lm_head.weight, targets.view(-1), rows)

    @staticmethod
    def decays(param):
        """Weight decay as users expect: matmul and embedding weights (>= 2-D) decay, biases and
        LayerNorm gains do not. ZeRO applies this per element of a flat shard, so it is a rule on
        the parameter, not a list of param groups."""
        return param.dim() >= 2

    def param_groups(self, weight_decay):
        """The two AdamW param groups of nanoGPT, for torch optimizers (stage 0 and the oracles)."""
        params = [p for p in self.parameters() if p.requires_grad]
        return [
            {'params': [p for p in params if self.decays(p)], 'weight_decay': weight_decay},
            {'params': [p for p in params if not self.decays(p)], 'weight_decay': 0.0},
        ]

    def flops_per_token(self):
        """Training FLOPs per token: 6N for the matmuls with N params (2 forward + 4 backward), plus
        the attention scores and values, 12 * n_layer * n_embd * T (PaLM appendix B)."""
        N = self.get_num_params()
        cfg = self.config
        return 6 * N + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size

    def estimate_mfu(self, tokens_per_second, peak_flops):
        """Model FLOPs utilization: achieved FLOP/s over the device's peak. None when the peak is
        unknown (on CPU we report nothing rather than invent a peak)."""
        if not peak_flops:
            return None
        return self.flops_per_token() * tokens_per_second / peak_flops

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Extend idx (B, T) by max_new_tokens tokens, sampling each from the softmax over the
        last position (crop the context to block_size when it grows past it)."""
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :].float()  # (B, vocab_size)
            # less the max first (softmax is the same): a tiny temperature then sends the rest to -inf, not the max to
            # inf (inf - inf: nan probabilities), so any temperature > 0 samples, and one near 0 decodes greedily; one
            # below fp32's smallest normal would be 0 in fp32 (0 / 0), so it is floored there
            temperature = max(temperature, torch.finfo(torch.float32).tiny)
            logits = (logits - logits.amax(-1, keepdim=True)) / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('Inf')
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


# -----------------------------------------------------------------------------
# [Note: chunked loss head] The logits of a batch are B*T x vocab_size: 12 x 1024 x 50304 = 618M values, 2.5 GB in
# fp32. A plain head keeps their fp32 log-softmax from forward to backward and adds two more tensors of that size as
# backward starts (the grads of the log-probs and of the logits). This one never holds more than one chunk of rows:
# for each chunk, the logits in the compute dtype, the loss in fp32 (logsumexp - the target's logit) and, while the
# chunk is at hand, the grads: d loss / d logits = (softmax - one_hot(target)) / count, which at once gives the
# chunk's share of the grads of x and of the weight. They are kept as the grads of the *summed* loss (softmax -
# one_hot, in [-1, 1]), and backward scales them by the incoming grad (the 1/micro-steps, a loss scale) / count: in
# fp16 a probability / count (2e-5 / 2048 at init with GPT-2's vocab) is below fp16's smallest number, and would
# flush to zero before the loss scale could lift it (a plain head's logits get their grad with the scale in it).
# fp16 also caps a chunk at 256 rows: the weight grad's sum over a chunk's rows (|g| <= 1) is an fp16 matmul's
# output, and stays below fp16's 65504 unless the head's inputs pass 256. The FLOPs are those of the plain head (one matmul forward, two backward), nothing is recomputed; what is
# saved for backward is the grad of x (B*T x C) and of the weight (vocab x C, fp32), not B*T x vocab. Under
# no_grad (evaluation) only the loss is computed. The same head for every stage and for the oracles (torch DDP,
# FSDP2 run this file too). Each op in the chunk loop runs once a chunk (GPT-2's 12 x 1024 tokens: 39 chunks), and eager
# on a GPU each is a kernel the host launches: the loop made near half of a micro-step's launches, and the host, not the
# GPU, could set the pace of eager training. So what does not change with the chunk is made once for the batch (the
# targets' columns, their masks, the transposed weight), each chunk writes its logsumexp and target logit into
# batch-long buffers that give the loss in one reduction after the loop, and the one-hot's -1 is one scatter_add_: 14
# launches a chunk, not 22, and half as many dispatched ops (609, not 1254, for GPT-2's head with a bf16 weight, counted
# by a TorchDispatchMode; test_model.py counts them).
LOSS_CHUNK = 2**24  # logits per chunk (64 MiB in fp32): GPT-2's vocab -> 320 rows a chunk


def loss_chunk_rows(vocab_size):
    return max(64, LOSS_CHUNK // vocab_size // 64 * 64)  # a multiple of 64 rows, for the matmuls


@torch.no_grad()  # it computes its own grads: nothing in it is for autograd
def chunked_cross_entropy(x, weight, targets, rows, grads):
    """x (N, C), weight (V, C), targets (N,) -> (mean loss over targets != -1, fp32; the count of those targets; and
    with grads=True the grads of the summed loss with respect to x (N, C, x's dtype) and weight (V, C, fp32): divided
    by the count, they are the mean's). The matmuls run in the autocast dtype when autocast is on (as lm_head's
    would), else in x's."""
    autocast = torch.is_autocast_enabled(x.device.type)
    dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
    rows = min(rows, 256) if dtype == torch.float16 else rows  # [Note: chunked loss head]
    w = weight.to(dtype)
    wt = w.t()
    valid = targets != -1
    count = valid.sum()
    # per row, made once for the batch, not per chunk (each op is a launch: [Note: chunked loss head]): the target's
    # column (ignored: 0), its -1 of the one-hot (ignored: 0), its mask, and buffers for its logsumexp and target logit
    cols, minus_one, keep = targets.clamp(min=0)[:, None], -valid[:, None].float(), valid[:, None]
    lse, picked = (torch.empty(x.size(0), 1, dtype=torch.float32, device=x.device) for _ in range(2))
    grad_x = torch.empty_like(x) if grads else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if grads else None
    per_row = (x, cols, minus_one, keep, lse, picked) + ((grad_x,) if grads else ())
    for xi, ci, minus_one_i, keep_i, lse_i, picked_i, *grad_xi in zip(*(t.split(rows) for t in per_row)):
        xi = xi.to(dtype)
        logits = (xi @ wt).float()  # (rows, V): the only vocab-sized tensor, one chunk at a time
        torch.logsumexp(logits, dim=-1, keepdim=True, out=lse_i)
        torch.gather(logits, 1, ci, out=picked_i)
        if grads:  # softmax - one_hot(target), written over the logits; 0 for an ignored target
            g = logits.sub_(lse_i).exp_().scatter_add_(1, ci, minus_one_i).mul_(keep_i).to(dtype)
            grad_xi[0].copy_(g @ w)  # (rows, C)
            grad_w += g.t() @ xi  # (V, C), accumulated in fp32 over the chunks
    loss = ((lse - picked) * keep).sum()  # fp32
    return loss / count, count, grad_x, grad_w


class LinearCrossEntropy(torch.autograd.Function):
    """cross_entropy(x @ weight.T, targets) whose forward also computes the grads ([Note: chunked loss head])."""

    @staticmethod
    def forward(ctx, x, weight, targets, rows):
        loss, count, grad_x, grad_w = chunked_cross_entropy(x, weight, targets, rows, grads=True)
        ctx.save_for_backward(grad_x, grad_w, count)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w, count = ctx.saved_tensors
        scale = grad_loss / count  # fp32: the incoming grad (1/micro-steps, a loss scale) and the mean's 1/count
        return grad_x * scale, (grad_w * scale).to(ctx.weight_dtype), None, None


def linear_cross_entropy(x, weight, targets, rows):
    """The mean cross-entropy of the logits x @ weight.T (N x V) against targets (-1: ignored), `rows` at a time."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(x, weight, targets, rows)
    return chunked_cross_entropy(x, weight, targets, rows, grads=False)[0]


def peak_flops(device):
    """Dense bf16 peak FLOP/s of the current GPU, for MFU; None where unknown (CPU, unlisted GPUs)."""
    if device.type != 'cuda':
        return None
    name = torch.cuda.get_device_name(device)
    table = {'H100 PCIe': 756e12, 'H100 NVL': 835e12, 'H200 NVL': 835e12, 'H800 PCIe': 756e12,  # before the SXM
             # parts' plain names: the first match wins
             'H100': 989e12, 'H200': 989e12, 'H800': 989e12, 'A100': 312e12, 'A800': 312e12,
             'L40S': 362e12, '4090': 165e12, 'A10G': 70e12}
    for key, flops in table.items():
        if key in name:
            return flops
    return None
