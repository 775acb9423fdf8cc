#!/usr/bin/env python3
"""Summarises a TANDEM_PDL_TRACE build's stamps (kernels.cu) of one layer of one decode step:
the layer's timeline (every block of its five kernels entering and leaving: gaps, tails,
placement); every block of the early-launched decode attention, and of the bulk o projection, which starts
(programmatic dependent launch) while that attention runs.

Attention: how long each phase took (wait over, inputs ready, scores, softmax, P.V, partials
added, output stored), median and slowest block. Bulk o: microseconds from the attention's first
wait-over (or the first o block's entry without attention stamps) to when its blocks entered,
saw the attention done, had their weights, exited. For both: how the blocks were placed
(multiprocessors holding 1, 2, 3... of them: an early launch places blocks where the previous
kernel's leave first).
Usage: pdl_trace.py LOG"""
import statistics
import sys

bulk, attn, gemv = [], [], {}
for line in open(sys.argv[1], errors="replace"):
    f = line.split()
    # pdl_trace gemv KIND BLOCK ENTRY READY EXIT SMID (kind 0 qkv, 1 gate/up, 2 down, 3 head)
    if len(f) == 8 and f[:2] == ["pdl_trace", "gemv"]:
        gemv.setdefault(int(f[2]), []).append(tuple(int(x) for x in f[4:8]))
    # pdl_trace bulk BLOCK ENTRY WAIT LANDED EXIT SMID
    if len(f) == 8 and f[:2] == ["pdl_trace", "bulk"]:
        bulk.append(tuple(int(x) for x in f[3:8]))
    # pdl_trace attn HEAD_GROUP SMID 8 STAMPS
    if len(f) == 12 and f[:2] == ["pdl_trace", "attn"]:
        attn.append(tuple(int(x) for x in f[3:12]))
if not bulk and not attn and not gemv:
    print("pdl trace: no stamps (a TANDEM_KERNEL_DEFINES=TANDEM_PDL_TRACE build?)")
    sys.exit(0)


def placement(smids):
    per_sm = {}
    for s in smids:
        per_sm[s] = per_sm.get(s, 0) + 1
    spread = {}
    for n in per_sm.values():
        spread[n] = spread.get(n, 0) + 1
    return f"{len(per_sm)} multiprocessors; holding n blocks: " + ", ".join(
        f"{n}: {spread[n]}" for n in sorted(spread))


def row(name, values):
    v = sorted(values)
    return f"{name:<26}{v[0]:8.2f}{statistics.median(v):8.2f}{v[-1]:8.2f}"


if attn:
    # attn tuples: (smid, entry, wait over, inputs, scores, softmax, P.V, sum, exit)
    phases = ["wait over", "inputs ready", "scores", "softmax", "P.V", "partials added", "output stored"]
    print(f"pdl trace: {len(attn)} blocks of one early decode attention; us per phase")
    print(f"pdl trace: {'':<26}{'min':>8}{'median':>8}{'max':>8}")
    for i, name in enumerate(phases):
        print("pdl trace: " + row(name, [(a[i + 2] - a[i + 1]) / 1000.0 for a in attn]))
    print("pdl trace: " + row("wait over -> stored", [(a[8] - a[2]) / 1000.0 for a in attn]))
    print("pdl trace: attention placement: " + placement(a[0] for a in attn))
if bulk:
    # bulk tuples: (entry, wait over, landed, exit, smid)
    t0 = min(a[2] for a in attn) if attn else min(b[0] for b in bulk)
    origin = "the attention's first wait over" if attn else "the first block's entry"
    print(f"pdl trace: {len(bulk)} blocks of one bulk o projection launch; us from {origin}")
    print(f"pdl trace: {'':<26}{'min':>8}{'median':>8}{'max':>8}")
    for i, name in enumerate(["entry", "attention done", "weights landed", "exit"]):
        print("pdl trace: " + row(name, [(b[i] - t0) / 1000.0 for b in bulk]))
    if attn:
        print("pdl trace: " + row("attention stored (blocks)", [(a[8] - t0) / 1000.0 for a in attn]))
    print("pdl trace: o placement: " + placement(b[4] for b in bulk))

if gemv.get(0):
    # One layer in launch order: when each kernel's blocks entered and exited, us from the qkv
    # projection's first entry. "gap" is first entry minus the previous kernel's last exit
    # (negative: launched early, programmatic dependent launch); "tail" is last exit minus
    # median exit; "ready.5" the projections' median end of prologue.
    t0 = min(g[0] for g in gemv[0])
    projections = {0: "qkv", 1: "gate/up", 2: "down"}

    def us(t):
        return (t - t0) / 1000.0

    def projection(kind):
        spans = [(g[0], g[2]) for g in gemv[kind]]
        return projections[kind], spans, statistics.median(us(g[1]) for g in gemv[kind])

    kernels = [projection(0)]
    if attn:
        kernels.append(("attention", [(a[1], a[8]) for a in attn], None))
    if bulk:
        kernels.append(("o (bulk)", [(b[0], b[3]) for b in bulk], None))
    kernels += [projection(kind) for kind in (1, 2) if gemv.get(kind)]
    print("pdl trace: one layer, us from the qkv projection's first entry")
    print(f"pdl trace: {'kernel':<12}{'blocks':>7}{'entry0':>8}{'entry1':>8}{'exit.5':>8}{'exit1':>8}{'gap':>7}"
          f"{'tail':>7}{'ready.5':>8}")
    prev_exit = None
    for name, spans, ready in kernels:
        entries = sorted(us(e) for e, _ in spans)
        exits = sorted(us(x) for _, x in spans)
        gap = f"{entries[0] - prev_exit:7.2f}" if prev_exit is not None else f"{'':>7}"
        ready = f"{ready:8.2f}" if ready is not None else ""
        print(f"pdl trace: {name:<12}{len(spans):>7}{entries[0]:8.2f}{entries[-1]:8.2f}"
              f"{statistics.median(exits):8.2f}{exits[-1]:8.2f}{gap}{exits[-1] - statistics.median(exits):7.2f}{ready}")
        prev_exit = exits[-1]
    for kind, name in projections.items():
        if gemv.get(kind):
            print(f"pdl trace: {name} placement: " + placement(g[3] for g in gemv[kind]))
