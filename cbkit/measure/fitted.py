"""Constants fitted to one machine: the CPU heap allowances of the memory planner. Every one of them lives here.

On a CPU the planner counts tensors, and glibc's malloc keeps freed blocks resident beside the new ones, so the
measured peak RSS stands above the tensors by an amount no formula gives: it depends on the allocator's history.
These allowances were fitted on this project's machine (2 CPU cores, glibc's malloc as it comes, torch 2.13 CPU,
SmolLM2-135M in fp32, one GSM8K prompt x N = 8..64, replayed and fixed lengths; docs/memory.md and
docs/measuring.md give the method and the current errors). Another CPU, allocator or torch may need other
values: refit them on a quiet machine with

    OMP_NUM_THREADS=2 python lab/refit_cpu_heap.py rollout 8,16,32,64     # CPU_HEAP_SLACK, CPU_HEAP_SLACK_MAX
    OMP_NUM_THREADS=2 python lab/refit_cpu_heap.py step 8,32              # CPU_CHUNK_HEAP_SLACK

The runs they were fitted on, number by number, are in lab/cpu_heap.md. None of them applies on a GPU, whose
caching allocator reuses its blocks by size: the plan counts tensors there.
"""

from __future__ import annotations

# glibc's largest dynamic mmap threshold on 64-bit Linux (malloc(3), M_MMAP_THRESHOLD): a block above it is mmapped
# and handed back when freed, so it leaves no heap behind. A fact of glibc, not a fit.
GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20

# generate()'s static batch grows its cache with torch.cat, freeing each layer's K and V every step: the heap kept
# beside the cache, as a share of the cache (the middle of the measured band)...
CPU_HEAP_SLACK = 0.46
# ... up to a cap, since it stops growing with the cache (the middle of the N = 64 readings).
CPU_HEAP_SLACK_MAX = 6 * GLIBC_MMAP_THRESHOLD_MAX

# A training step's chunked backward: the heap its earlier chunks leave resident under a later chunk's backward, as a
# share of one chunk's (logits + activations + LM-head gradient); the level reached with several chunks.
CPU_CHUNK_HEAP_SLACK = 0.25
