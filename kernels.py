"""
One fused AdamW step over a rank's flat ZeRO shard, three ways:

    reference   plain PyTorch, in the op order of torch.optim.AdamW: the definition the kernels are tested against
    cpu         a C++/OpenMP loop, compiled with the system C++ compiler into a plain shared library (library.py)
    cuda        a CUDA kernel, same math, compiled with nvcc into a plain shared library, launched on the current stream

The storage of the shard's weights and moments (its precision mode) is read from the tensors' dtypes:

    master      fp32 (param: none, fp32, bf16 or fp16, written from it), int16 remainder (param bf16), or None (param bf16)
    exp_avg/sq  fp32, bf16, or uint8 codes of a blockwise 8-bit code (256 elements per fp32 absmax)
    grad        fp32 or bf16

One pass over memory. fp32 master, m, v, grad and a bf16 param: per element 8 + 8 + 8 (master, m, v read+write)
+ 4 (grad) + 2 (param) = 30 bytes, where torch's fused AdamW followed by `param.copy_(master)` moves 28 + 6 = 34.
Remainder master and uint8 state: 8 (bf16 param and remainder, read+write) + 4 (grad) + 4 (codes, read+write)
+ 4 * 4/256 (absmax) = 16.06 bytes.

    python -m pytest -q test_kernels.py
    python bench.py kernels --sizes 1M,16M [--modes]
"""
import ctypes
import functools
import warnings
from dataclasses import dataclass

import torch

import host_allocator  # noqa: F401  before this module's tables: [Note: huge pages on CPU]
import library

# ----------------------------------------------------------------------------
# precision modes: what a shard keeps per element, for the ZeRO layout and its memory tables


@dataclass(frozen=True)
class Precision:
    """How the optimizer stores the weights and Adam's moments.
    master_weights: 'fp32' (a full fp32 copy), 'remainder' (the 16 bits a bf16 param lacks, [Note: remainder
    master]) or 'none' (the bf16 params are the only copy); state_dtype: 'float32', 'bfloat16' or 'int8'
    ([Note: 8-bit state]); stochastic_rounding: round the bf16 params stochastically (only without a master)."""
    master_weights: str = 'fp32'
    state_dtype: str = 'float32'
    stochastic_rounding: bool = False

    def check(self, param_dtype):
        if self.master_weights not in ('fp32', 'remainder', 'none'):
            raise ValueError(f"master_weights={self.master_weights!r}: use 'fp32', 'remainder' or 'none'")
        if self.state_dtype not in ('float32', 'bfloat16', 'int8'):
            raise ValueError(f"state_dtype={self.state_dtype!r}: use 'float32', 'bfloat16' or 'int8'")
        if self.master_weights != 'fp32' and param_dtype != torch.bfloat16:
            raise ValueError(f"master_weights={self.master_weights!r} keeps the weights in bf16 params, but "
                             f"param_dtype is {param_dtype}: use param_dtype bfloat16 or master_weights='fp32'")
        if self.stochastic_rounding and self.master_weights != 'none':
            raise ValueError("stochastic_rounding rounds the only copy of the weights: it needs master_weights='none' "
                             f"(got {self.master_weights!r}, whose params are rounded from a master)")

    def master_dtype(self, param_dtype):
        """torch.float32, torch.int16 (remainder) or None (no master, or fp32 params that are the master)."""
        if self.master_weights == 'fp32':
            return None if param_dtype == torch.float32 else torch.float32
        return torch.int16 if self.master_weights == 'remainder' else None

    @property
    def state_torch_dtype(self):
        return {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'int8': torch.uint8}[self.state_dtype]

    @property
    def align(self):
        """Shard lengths must be a multiple of this: int8 blocks never straddle ranks."""
        return 256 if self.state_dtype == 'int8' else 1

    def zero_moments(self, n, device):
        """(exp_avg, exp_avg_sq, absmax) of an n-element shard, all zero: fp32 or bf16 tensors and absmax None,
        or 8-bit codes of zero with one fp32 absmax per 256-element block, (exp_avg's, exp_avg_sq's)."""
        if self.state_dtype != 'int8':
            return (*(torch.zeros(n, dtype=self.state_torch_dtype, device=device) for _ in range(2)), None)
        if n % 256:  # the one caller pads every shard to the block (self.align); a ragged tail would have no absmax
            raise ValueError(f"8-bit moments come in blocks of 256 elements: {n} is not a multiple of 256 (pad the shard)")
        # the code of 0 (signed map: 127, unsigned: 0) filled in, not n zeros quantized (~17 bytes an element at once)
        m, v = (torch.full((n,), int(quantize(torch.zeros(256, device='cpu'), signed)[0][0]), dtype=torch.uint8,
                           device=device) for signed in (True, False))
        return m, v, tuple(torch.zeros(n // 256, device=device) for _ in range(2))

    def bytes_per_element(self, param_dtype):
        master = self.master_dtype(param_dtype)
        state = {'float32': 4, 'bfloat16': 2, 'int8': 1 + 4 / 256}[self.state_dtype]  # int8: + one fp32 absmax per 256
        return {'master': master.itemsize if master else 0, 'exp_avg': state, 'exp_avg_sq': state}

    def warning(self):
        if self.master_weights == 'none' and self.state_dtype != 'float32':
            return (f"master_weights='none' with {self.state_dtype} state keeps no fp32 copy of the weights and "
                    "low-precision moments: in a public comparison of the same 8-bit AdamW with and without ZeRO-3's "
                    "fp32 master weights, the run without them converged worse (master_weights='remainder' costs 2 B)")
        return None

# ----------------------------------------------------------------------------
# the definitions, in torch: bf16 roundings, the remainder split, the rounding hash, the 8-bit code

# [Note: one bf16 rounding rule]
# With an fp32 master, the bf16 param is the master rounded half away from zero (RNA: add 0x8000 to the bits and
# truncate), not to nearest-even. The remainder mode keeps only the bf16 param plus the low 16 bits of the fp32
# master, and must write the same bf16 params as an fp32-master run, so that the two are bit-identical end to end.
# A bf16 rounded to nearest-even cannot always be completed back to its fp32 by 16 bits: 65,537 fp32 values round to
# each even bf16 (the ties from both sides), one too many. Rounded away from zero, the bf16 is the high half, or the
# high half + 1 when bit 15 of the low half is set: the low half says which, so 16 bits suffice. NaN stays a (quiet)
# NaN; a value that rounds past the largest finite bf16 becomes inf. Without a master the bf16 param is rounded to
# nearest-even, or stochastically; bf16 moments to nearest-even; fp16 params to nearest-even (as .to(torch.float16)).


def _unsigned(x):
    """The bits of an fp32/int16/int32/bf16 tensor as non-negative int64, so that adds and shifts cannot overflow."""
    return x.view({2: torch.int16, 4: torch.int32}[x.itemsize]).to(torch.int64) & ((1 << 8 * x.itemsize) - 1)


def _from_unsigned(u, dtype):
    """Inverse of _unsigned: non-negative int64 bit patterns -> a tensor of dtype with those bits."""
    width = 8 * dtype.itemsize
    return (u - ((u >> (width - 1)) << width)).to({16: torch.int16, 32: torch.int32}[width]).view(dtype)


def _round_bf16(x32, below):
    """bf16 of fp32 bits + below (< 2^16), truncated; NaN -> quiet NaN (the add could carry a NaN into inf). In int32:
    the add overflows only for NaN patterns, which the where replaces; a negative's high half, shifted, is its int16."""
    bits = x32.view(torch.int32)
    below = below.to(torch.int32) if torch.is_tensor(below) else below
    return torch.where(x32.isnan(), (bits >> 16) | 0x40, (bits + below) >> 16).to(torch.int16).view(torch.bfloat16)


def cast_param(master32, dtype, impl="reference", out=None):
    """The compute param written from an fp32 master: bf16 rounded half away from zero ([Note: one bf16 rounding
    rule]), fp16 rounded to nearest-even, fp32 a copy. impl='auto' (a stage-3 gather) rounds a contiguous master to
    bf16 in the device's kernel library, one pass, where the torch ops take seven. out: a tensor of dtype and the
    master's numel to write into (a stage-3 gather's slice of its unsharded param) instead of a new one."""
    if master32.dtype != torch.float32:  # the kernel reads 4 bytes an element
        raise TypeError(f"cast_param: the master is {master32.dtype}: pass the fp32 master")
    if out is not None and (out.dtype, out.numel(), out.device) != (dtype, master32.numel(), master32.device):
        raise ValueError(f"cast_param: out is {out.dtype} x {out.numel()} on {out.device}, the cast {dtype} x "
                         f"{master32.numel()} on {master32.device}")
    impl = "reference" if dtype != torch.bfloat16 else resolve_impl(impl, master32.device)
    if impl == "reference" or not master32.is_contiguous() or not (out is None or out.is_contiguous()):
        # fp16 (nearest-even) and fp32: copy_ rounds as .to does, so into out it is one pass
        x = _round_bf16(master32, 0x8000) if dtype == torch.bfloat16 else master32
        return x.to(dtype, copy=x is master32) if out is None else out.copy_(x.reshape(out.shape))
    if impl != master32.device.type:
        raise ValueError(f"impl={impl!r} cannot run on {master32.device} tensors")
    if out is None:
        out = torch.empty(master32.shape, dtype=torch.bfloat16, device=master32.device)
    _LIBRARIES[impl].call("cast_bf16", master32.device, ctypes.c_void_p(master32.data_ptr()),
                          ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(master32.numel()))
    return out


# [Note: remainder master]
# TransformerEngine's store_param_remainders: the fp32 master is the bf16 param's 16 bits as the high half and an
# int16 "remainder" as the low half, 2 bytes per element instead of 4. The bf16 was rounded half away from zero, so
# when bit 15 of the low half is set (the int16 is negative) the bf16 is one ulp above the high half: decoding
# subtracts one first. E.g. 1.00390625 + 2^-17 = 0x3F808040 -> bf16 0x3F81, remainder 0x8040 (negative) ->
# 0x3F81 - 1 = 0x3F80 -> 0x3F808040 again. Any write to the bf16 param outside the optimizer corrupts the master.

def split_master(x32):
    """fp32 -> (bf16 param, int16 remainder) with join_master(*split_master(x)) == x for every non-NaN x."""
    return cast_param(x32, torch.bfloat16), _from_unsigned(_unsigned(x32) & 0xFFFF, torch.int16)


def join_master(param, remainder):
    """(bf16 param, int16 remainder) -> the fp32 master."""
    high = (_unsigned(param) - (remainder < 0).long()) & 0xFFFF
    return _from_unsigned((high << 16) | _unsigned(remainder), torch.float32)


# [Note: stochastic rounding, reproducibly]
# Without a master, a bf16 param rounded to nearest loses every update smaller than half its ulp. Stochastic rounding
# adds a uniform 16-bit random number to the fp32 bits below the cut and truncates, so it rounds up in magnitude with
# probability (discarded low 16 bits) / 2^16 and the expected bf16 is the fp32 value. The random number is the low
# half of a hash of (rounding_seed, step, index in the full flat buffer): no RNG state, a resumed run re-rounds
# identically, and it does not depend on how the buffer is sharded. The hash chains Chris Wellons' 32-bit integer
# mixer "lowbias32" (x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16): a key per step,
# key = mix(mix(seed) ^ step), then one mix an element, h = mix(f * (key | 1) + key mod 2^32), f = lo ^ hi * 0x9e3779b9
# (the index's halves: models > 2^32 params). The odd multiplier, new each step, makes an element's inputs of two steps
# differ by an amount of its own (lo ^ key: one xor for all). One mix, not two: 0.96x the CUDA stochastic 8-bit step's
# time on one H200 (6 of its 133 instructions an element), 0.97x on 2 CPU cores (assets/kernels_8bit.md).

def _mul32(x, c):
    """x * c mod 2^32 for x < 2^32 in int64, without overflow: each partial product is < 2^48."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _lowbias32(x):
    x = _mul32(x ^ (x >> 16), 0x7FEB352D)
    x = _mul32(x ^ (x >> 15), 0x846CA68B)
    return x ^ (x >> 16)


def rounding_hash(seed, step, index):
    """32 random bits (in int64) per element of index (int64 >= 0): [Note: stochastic rounding, reproducibly]."""
    key = _lowbias32(_lowbias32(seed) ^ step)
    folded = (index & 0xFFFFFFFF) ^ _mul32(index >> 32, 0x9E3779B9)
    return _lowbias32((_mul32(folded, key | 1) + key) & 0xFFFFFFFF)


def round_stochastic(x32, seed, step, index_offset=0):
    """fp32 (n,) -> bf16, each element up in magnitude with probability (its low 16 bits) / 2^16."""
    index = torch.arange(x32.numel(), device=x32.device) + index_offset
    return _round_bf16(x32, rounding_hash(seed, step, index) & 0xFFFF)


# [Note: 8-bit state]
# Blockwise 8-bit Adam (Dettmers et al., arXiv 2110.02861): each block of 256 consecutive elements keeps one fp32
# absmax and 256 uint8 codes. A code indexes the "dynamic" map, 256 values in [-1, 1] (signed, for exp_avg) or
# [0, 1] (unsigned, for exp_avg_sq) that are dense near 0, so small moments keep their relative precision. The value
# of a code's bits: the sign bit (signed map), then a run of z zero bits giving the exponent 10^-z, an indicator 1
# bit, and the remaining bits a linear fraction: the midpoints of 2^bits equal bins of [0.1, 1]. E.g. unsigned
# 0b00101100: z = 2, the indicator, fraction bits 01100 = 12 of 5 -> 10^-2 * (0.1 + 0.9 * 12.5/32) = 0.0045156.
# The two codes with no indicator bit within the 7 exponents hold 0 and 1 (so the element at the absmax is stored
# exactly). The maps equal bitsandbytes' and torchao's create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)
# bit for bit. Quantizing: absmax = max |x| over the block, xn = x / absmax (x / 1 for an all-zero block), and the
# code is the nearest map value: the number of midpoints between adjacent map values strictly below xn (ties go to
# the lower). The step dequantizes (map[code] * absmax), updates in fp32 and uses the new fp32 m and v for the param
# update (as torchao's AdamW8bit does), then requantizes. Worst error: half the largest gap between codes, times absmax.

def dynamic_map(signed):
    """The 256 values of the 8-bit dynamic code, sorted ascending (fp32): [Note: 8-bit state]."""
    magnitude_bits = 7 if signed else 8  # the unsigned map spends the sign bit on the fraction
    values = []
    for code in range(256):
        magnitude = code & ((1 << magnitude_bits) - 1)
        zeros = magnitude_bits - magnitude.bit_length()  # the exponent: 10^-zeros
        if zeros >= 7:  # no indicator bit: the two codes left over hold 0 and +1
            values.append(float(code != 0))
            continue
        fraction_bits = magnitude_bits - 1 - zeros
        fraction = magnitude & ((1 << fraction_bits) - 1)
        bins = torch.linspace(0.1, 1, 2 ** fraction_bits + 1, device='cpu')  # fp32, as the public definitions
        value = ((bins[fraction] + bins[fraction + 1]) / 2 * 10.0 ** -zeros).item()
        values.append(-value if signed and code >> 7 else value)
    return torch.tensor(sorted(values), device='cpu')


SIGNED_MAP, UNSIGNED_MAP = dynamic_map(signed=True), dynamic_map(signed=False)  # (256,) fp32 each


def _midpoints(q):
    return (q[:-1] + q[1:]) / 2  # (255,) fp32


def _buckets(midpoints):
    """(2^16,) int32: for each bucket of the fp32 values that share their top 16 bits, the midpoints below it, and the
    threshold on the low 16 bits past which a value is above the one midpoint inside it: [Note: a code in one load]
    (csrc/adamw_common.h, beside the lookup)."""
    top = torch.arange(1 << 16, device='cpu')  # built once on the CPU, whatever the default device, then moved
    negative = top >= 0x8000  # there the smallest value has the largest low half
    lowest = _from_unsigned(torch.where(negative, top << 16 | 0xFFFF, top << 16), torch.float32)
    highest = _from_unsigned(torch.where(negative, top << 16, top << 16 | 0xFFFF), torch.float32)
    below = torch.searchsorted(midpoints, lowest)  # NaN buckets: 255, as for a NaN itself
    inside = torch.searchsorted(midpoints, highest) - below  # midpoints in [lowest, highest)
    assert inside.max() <= 1, "a bucket holds two midpoints"
    key = (_unsigned(midpoints[below.clamp(max=254)]) & 0xFFFF) ^ torch.where(negative, 0xFFFF, 0)
    threshold = torch.where(inside == 1, key + 1, 1 << 16)  # key(xn) >= key(midpoint) + 1: xn above the midpoint
    return (below | threshold << 8).to(torch.int32)


@functools.lru_cache(maxsize=None)
def _code_tables(device):
    """The kernels' tables, on device: fp32 (512,) = the signed and unsigned maps (256 each); int32 (2 * 2^16,) = the
    buckets of the signed, then the unsigned, midpoints, each rotated by half (negative values' buckets first: the
    kernels index them by xn's top 16 bits read as signed, [Note: table lookups that vectorize])."""
    signed, unsigned = _midpoints(SIGNED_MAP), _midpoints(UNSIGNED_MAP)
    return (torch.cat([SIGNED_MAP, UNSIGNED_MAP]).to(device),
            torch.cat([_buckets(signed).roll(1 << 15), _buckets(unsigned).roll(1 << 15)]).to(device))


@functools.lru_cache(maxsize=None)
def _maps_on(device, signed):
    """(map, midpoints) of one code map on device, copied there once: a copy from pageable host memory makes the host
    wait for the GPU, and the reference step would otherwise make four a bucket a step."""
    table = SIGNED_MAP if signed else UNSIGNED_MAP
    return table.to(device), _midpoints(table).to(device)


def quantize(x32, signed):
    """fp32 (n,), n a multiple of 256 -> (uint8 codes (n,), fp32 absmax (n/256,)). NaNs are ignored by the absmax."""
    blocks = x32.view(-1, 256)
    absmax = torch.where(blocks.isnan(), 0.0, blocks.abs()).amax(dim=1)
    scale = torch.where(absmax > 0, absmax, 1.0)
    midpoints = _maps_on(x32.device, signed)[1]
    return torch.searchsorted(midpoints, blocks / scale[:, None], out_int32=True).to(torch.uint8).view(-1), absmax


def dequantize(codes, absmax, signed):
    """uint8 codes (n,) and fp32 absmax (n/256,) -> fp32 (n,)."""
    values = _maps_on(codes.device, signed)[0][codes.long()]
    return (values.view(-1, 256) * absmax[:, None]).view(-1)

# ----------------------------------------------------------------------------
# reference: the definition


def adamw_step_reference(master, grad, exp_avg, exp_avg_sq, param, found_inf, *, lr, beta1, beta2, eps, weight_decay,
                         decay_numel, step, grad_scale=1.0, absmax=None, rounding_seed=None, index_offset=0):
    """torch.optim.AdamW's single-tensor step on a flat shard, plus the grad scale, found_inf, and each storage mode's
    decode before and encode after. With fp32 master and state it is torch's op order, on the tensors in place."""
    g = grad.float() * grad_scale  # unscale (loss scale, clip coefficient) before anything reads the grad
    torch.maximum(found_inf, (~g.isfinite()).any().float(), out=found_inf)  # no host sync
    absmax = absmax or (None, None)
    x = load_weights(master, param)
    m, v = load_state(exp_avg, absmax[0], signed=True), load_state(exp_avg_sq, absmax[1], signed=False)
    x[:decay_numel].mul_(1 - lr * weight_decay)  # decoupled weight decay, decayed params only
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    denom = (v.sqrt() / bias_correction2 ** 0.5).add_(eps)
    x.addcdiv_(m, denom, value=-lr / bias_correction1)
    store_state(m, exp_avg, absmax[0], signed=True)
    store_state(v, exp_avg_sq, absmax[1], signed=False)
    store_weights(x, master, param, rounding_seed, step, index_offset)


# The codec of each mode, for whole shards: the reference step below, and zero.py / checkpoint.py (which store the
# initial weights, and weights and moments read from a checkpoint of another layout) use these four.

def load_weights(master, param):
    """The fp32 weights of a shard from what it stores: the master itself when it is fp32 (a view, not a copy)."""
    if master is None:
        return param.float()
    return join_master(param, master) if master.dtype == torch.int16 else master


def store_weights(x32, master, param, rounding_seed=None, step=0, index_offset=0):
    """Store fp32 weights in the shard's form: fp32 master (+ its param rounding), remainder, or the bf16 params."""
    if master is None:
        param.copy_(x32.to(torch.bfloat16) if rounding_seed is None else
                    round_stochastic(x32, rounding_seed, step, index_offset))
    elif master.dtype == torch.int16:
        high, low = split_master(x32)
        param.copy_(high)
        master.copy_(low)
    else:
        if master is not x32:
            master.copy_(x32)
        if param is not None:
            param.copy_(cast_param(x32, param.dtype))


def load_state(state, absmax, signed):
    if state.dtype == torch.uint8:
        return dequantize(state, absmax, signed)
    return state if state.dtype == torch.float32 else state.float()


def store_state(x32, state, absmax, signed):
    if state.dtype == torch.uint8:
        codes, new_absmax = quantize(x32, signed)
        state.copy_(codes)
        absmax.copy_(new_absmax)
    elif state is not x32:
        state.copy_(x32)  # bf16: rounded to nearest-even

# ----------------------------------------------------------------------------
# the kernels' sources are in csrc/ (library.py builds them): the shared part (the args, the roundings, the weights
# policies, the element update), the CPU loop, the CUDA kernels

# [Note: weight decay as one index]
# A per-element decay mask would cost a byte per element of reading. The ZeRO layout sorts params so that
# in each flat bucket all decayed params (the >= 2-D weights) come first, so a shard is
# [decayed | not decayed] and one integer says where the split is: elements i < decay_numel are decayed.
# E.g. a shard of 10 elements holding the last 6 of a weight and a 4-element bias: decay_numel = 6.
# The cheaper equivalent of the mask: the CPU runs two loops, the GPU does one compare per element.

# ----------------------------------------------------------------------------
# which kernel: library.py builds and loads the libraries, each once a process


def announce_build(impl, device, log):
    """Say so before a first run builds the library (every rank builds or loads it before its first collective)."""
    kind = device.type if impl == "auto" else impl
    try:
        if kind in ("cpu", "cuda") and not library.cache_path(kind).exists():
            log(f"building the fused AdamW kernel for {kind} (first run only, a few seconds; cached in "
                f"{library.cache_path(kind)})")
    except RuntimeError:
        pass  # it cannot be built here: resolve_impl says why


_LIBRARIES = {}  # 'cpu' / 'cuda' -> the loaded Library, or the RuntimeError its build raised


def resolve_impl(name="auto", device=torch.device("cpu")):
    """'auto' -> 'cuda' / 'cpu' for the device if that kernel builds, else 'reference' with one warning.
    Forcing 'cpu' or 'cuda' raises RuntimeError if it cannot build. Builds at most once per process."""
    if name == "reference":
        return name
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"impl must be 'auto', 'reference', 'cpu' or 'cuda', not {name!r}")
    kernel = torch.device(device).type if name == "auto" else name
    if kernel not in ("cpu", "cuda"):
        return "reference"  # e.g. 'auto' on a meta device: there is no kernel to try
    first_try = kernel not in _LIBRARIES
    if first_try:
        try:
            if kernel == "cuda" and not torch.cuda.is_available():
                raise RuntimeError("no CUDA device (torch.cuda.is_available() is False)")
            _LIBRARIES[kernel] = library.build(kernel)
        except RuntimeError as e:
            _LIBRARIES[kernel] = e
    if not isinstance(_LIBRARIES[kernel], RuntimeError):
        return kernel
    if name != "auto":
        raise RuntimeError(f"kernels: impl={name!r} is not available: {_LIBRARIES[kernel]}")
    if first_try:
        warnings.warn(f"kernels: using the PyTorch reference AdamW step: {_LIBRARIES[kernel]}", stacklevel=2)
    return "reference"

# ----------------------------------------------------------------------------
# the API zero.py calls

_GRAD_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_STATE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2}
# (master dtype, param dtype) -> the C++ weights policy; 6 is (None, bf16) rounded stochastically
_WEIGHTS_KINDS = {(torch.float32, None): 0, (torch.float32, torch.float32): 1, (torch.float32, torch.bfloat16): 2,
                  (torch.float32, torch.float16): 3, (torch.int16, torch.bfloat16): 4, (None, torch.bfloat16): 5}


def _dtype(t):
    return None if t is None else t.dtype


def _check(tensors, decay_numel, rounding_seed):
    """What the kernels assume before they take raw pointers: ValueError / TypeError naming the tensor."""
    grad, exp_avg, uint8 = tensors["grad"], tensors["exp_avg"], tensors["exp_avg"].dtype == torch.uint8
    n = grad.numel()
    if grad.dtype not in _GRAD_KINDS:
        raise TypeError(f"adamw_step: grad must be float32 or bfloat16, got {grad.dtype}")
    if exp_avg.dtype not in _STATE_KINDS or tensors["exp_avg_sq"].dtype != exp_avg.dtype:
        raise TypeError("adamw_step: exp_avg and exp_avg_sq must both be float32, both bfloat16 or both uint8, got "
                        f"{exp_avg.dtype} and {tensors['exp_avg_sq'].dtype}")
    weights = (_dtype(tensors["master"]), _dtype(tensors["param"]))
    if weights not in _WEIGHTS_KINDS:
        raise TypeError(f"adamw_step: (master, param) dtypes {weights} are not a mode; use one of {list(_WEIGHTS_KINDS)}")
    if uint8 and (n % 256 or tensors["exp_avg_absmax"] is None or tensors["exp_avg_sq_absmax"] is None):
        raise ValueError(f"adamw_step: uint8 state needs n a multiple of 256 (blocks of 256; pad the shard to "
                         f"Precision.align) and absmax=(exp_avg_absmax, exp_avg_sq_absmax): got n={n}")
    if not uint8 and tensors["exp_avg_absmax"] is not None:
        raise ValueError("adamw_step: absmax is only for uint8 state")
    for name, t in tensors.items():
        if t is None:
            continue
        numel = 1 if name == "found_inf" else n // 256 if name.endswith("absmax") else n
        if t.device != grad.device or t.numel() != numel or not t.is_contiguous():
            raise ValueError(f"adamw_step: {name} must be contiguous with {numel} elements on {grad.device}, "
                             f"got {'a non-contiguous' if not t.is_contiguous() else 'a'} {tuple(t.shape)} on {t.device}")
        if t.dtype != torch.float32 and (name == "found_inf" or name.endswith("absmax")):
            raise TypeError(f"adamw_step: {name} must be float32, got {t.dtype}")
    if rounding_seed is not None and (tensors["master"] is not None or not 0 <= rounding_seed < 2**32):
        raise ValueError("adamw_step: rounding_seed (an int in [0, 2^32)) rounds a bf16 param that has no master; "
                         f"got rounding_seed={rounding_seed} with master {weights[0]}")
    if not 0 <= decay_numel <= n:
        raise ValueError(f"adamw_step: decay_numel={decay_numel} is outside [0, {n}]")


def _pack(tensors, hp):
    """The C args for one step: pointers, kinds, and the step's constants in double, rounded to float by ctypes."""
    a = library.AdamWArgs(**{name: None if t is None else t.data_ptr() for name, t in tensors.items()})
    if tensors["exp_avg"].dtype == torch.uint8:
        a.tables, a.buckets = (t.data_ptr() for t in _code_tables(tensors["grad"].device))
    a.n, a.decay_numel, a.index_offset = tensors["grad"].numel(), hp["decay_numel"], hp["index_offset"]
    a.grad_kind, a.state_kind = _GRAD_KINDS[tensors["grad"].dtype], _STATE_KINDS[tensors["exp_avg"].dtype]
    a.weights_kind = 6 if hp["rounding_seed"] is not None else \
        _WEIGHTS_KINDS[_dtype(tensors["master"]), _dtype(tensors["param"])]
    a.seed, a.step = hp["rounding_seed"] or 0, hp["step"]
    beta1, beta2, lr = hp["beta1"], hp["beta2"], hp["lr"]
    a.grad_scale, a.one_minus_beta1, a.beta2, a.one_minus_beta2 = hp["grad_scale"], 1 - beta1, beta2, 1 - beta2
    a.eps, a.decay = hp["eps"], 1 - lr * hp["weight_decay"]
    a.step_size = lr / (1 - beta1 ** hp["step"])
    a.bias_correction2_sqrt = (1 - beta2 ** hp["step"]) ** 0.5
    return a


def adamw_step(master, grad, exp_avg, exp_avg_sq, param, found_inf, *, lr, beta1, beta2, eps, weight_decay,
               decay_numel, step, grad_scale=1.0, absmax=None, rounding_seed=None, index_offset=0, impl="auto"):
    """One AdamW step on a flat shard of n elements, all tensors 1-D contiguous on one device; the mode is read from
    the dtypes (module docstring). master: fp32, int16 remainder or None; param: None, fp32, bf16 or fp16 (written;
    also read when master is int16 or None; may be a view into a bigger buffer); grad: fp32 or bf16; exp_avg,
    exp_avg_sq: both fp32, bf16 or uint8, with absmax=(exp_avg_absmax, exp_avg_sq_absmax) fp32 (n/256,) for uint8;
    found_inf: fp32 (1,). step is the 1-based step count for bias correction. Elements i < decay_numel get weight
    decay ([Note: weight decay as one index]). grad is multiplied by grad_scale first, so loss-scale unscaling and
    the clip coefficient are free. found_inf is set to 1.0 if any scaled grad is inf/nan and never reset: check it
    once after all buckets. The outputs are written either way. With master None, rounding_seed (int) rounds the
    param stochastically at index_offset + i ([Note: stochastic rounding, reproducibly])."""
    exp_avg_absmax, exp_avg_sq_absmax = absmax or (None, None)
    tensors = dict(master=master, param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                   exp_avg_absmax=exp_avg_absmax, exp_avg_sq_absmax=exp_avg_sq_absmax, found_inf=found_inf)
    _check(tensors, decay_numel, rounding_seed)
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1 and step >= 1):  # the CUDA 8-bit kernel relies on it: adamw_common.h
        raise ValueError(f"adamw_step: needs 0 <= beta1, beta2 < 1 and a 1-based step (as torch's AdamW), got "
                         f"beta1={beta1}, beta2={beta2}, step={step}")
    hp = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, decay_numel=decay_numel, step=step,
              grad_scale=grad_scale, rounding_seed=rounding_seed, index_offset=index_offset)
    impl = resolve_impl(impl, grad.device)
    if impl == "reference":
        adamw_step_reference(master, grad, exp_avg, exp_avg_sq, param, found_inf, absmax=absmax, **hp)
        return
    if impl != grad.device.type:
        raise ValueError(f"impl={impl!r} cannot run on {grad.device} tensors")
    _LIBRARIES[impl].call("adamw_step", grad.device, ctypes.byref(_pack(tensors, hp)))
