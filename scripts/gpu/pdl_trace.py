#!/usr/bin/env python3
"""Summarises a TANDEM_PDL_TRACE build's stamps (kernels.cu): every block of one launch of the
bulk o projection, which starts (programmatic dependent launch) while the decode attention
before it runs. Microseconds from the first block's entry: when the blocks entered, when their
wait for the attention ended, when their weights had landed, when they exited.
Usage: pdl_trace.py LOG"""
import statistics
import sys

bulk = []
for line in open(sys.argv[1], errors="replace"):
    f = line.split()
    if len(f) == 8 and f[:2] == ["pdl_trace", "bulk"]:
        bulk.append(tuple(int(x) for x in f[3:8]))
if not bulk:
    print("pdl trace: no stamps (a TANDEM_KERNEL_DEFINES=TANDEM_PDL_TRACE build?)")
    sys.exit(0)
t0 = min(b[0] for b in bulk)
print(f"pdl trace: {len(bulk)} blocks of one bulk o projection launch; us from the first block's entry")
print(f"pdl trace: {'':<24}{'min':>8}{'median':>8}{'max':>8}")
for i, name in enumerate(["entry", "attention done", "weights landed", "exit"]):
    v = sorted((b[i] - t0) / 1000.0 for b in bulk)
    print(f"pdl trace: {name:<24}{v[0]:8.2f}{statistics.median(v):8.2f}{v[-1]:8.2f}")
