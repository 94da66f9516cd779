"""
host_allocator: how this process's CPU memory is allocated, set once, before the first tensor (kernels.py imports it
first thing, and every entry point imports kernels before it allocates). A GPU has torch's caching allocator; on a
CPU torch asks malloc for every buffer, and stage 3's gathers and stage 2's grad buckets come and go each step.
"""
import contextlib
import ctypes
import os
import sys

# [Note: huge pages on CPU] fsdp_lite frees a unit's unsharded param after each use and allocates it again before the
# next; stage 2's grad buffers come and go each step. On CPU a fresh buffer faults its pages in, one per 4 KiB; with
# THP_MEM_ALLOC_ENABLE=1 torch asks for transparent huge pages (madvise) for buffers of 2 MB and more: 512x fewer. torch
# reads it at its first CPU allocation (hence this module's place); a user's setting wins. config/shakespeare_cpu.py,
# 2 gloo ranks, compiled: stage 2 504 -> 453 ms a step, stage 3 543 -> 468 ms (stage 3 / stage 2 1.06-1.10x ->
# 0.99-1.07x, 3 alternating runs each way); the root unit's gather copy 22.7 -> 2.9 ms.
os.environ.setdefault('THP_MEM_ALLOC_ENABLE', '1')

# [Note: the host allocator's mmap threshold] glibc maps a buffer of at least its mmap threshold on its own (unmapped
# when freed) and cuts smaller ones from its heap, which keeps what is freed. The threshold rises to the size of every
# mapped buffer freed, up to 32 MiB: once stage 3 frees its root unit (config/shakespeare_cpu.py: 26 MB), every later
# buffer under that comes from the heap, where a step's buffers of many lifetimes leave holes. Fixing it also stops glibc
# raising its trim threshold with it (to twice the mmap threshold; at 128 KiB the heap's top goes back to the OS and
# faults in again), so that one is set to 32 MiB, as glibc would. Fixed at 16 MiB, compiled stage 3's peak RSS went
# from 1.07-1.24x stage 2's to 0.97-1.02x, its step from 1.01x to 1.04x (its root's gather faults a fresh mapping in;
# assets/stage3_cpu.md). A user's own thresholds win (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or
# GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...); off glibc, nothing is set.
MMAP_THRESHOLD = 16 << 20
if sys.platform.startswith('linux') and not ('MALLOC_MMAP_THRESHOLD_' in os.environ
                                             or 'mmap_threshold' in os.environ.get('GLIBC_TUNABLES', '')):
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, MMAP_THRESHOLD)  # -3: M_MMAP_THRESHOLD
        if not ('MALLOC_TRIM_THRESHOLD_' in os.environ or 'trim_threshold' in os.environ.get('GLIBC_TUNABLES', '')):
            libc.mallopt(-1, 2 * MMAP_THRESHOLD)  # -1: M_TRIM_THRESHOLD, as glibc's own rule sets it
