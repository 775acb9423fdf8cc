#!/usr/bin/env python3
"""A model of the ring decode kernel's producer/consumer protocol (decode_ring in
crates/compute/src/cuda/kernels.cu), run under random schedules: one block's stream of stages,
chunks issued only once every consumer warp's published position is past the chunk they
overwrite, warps owning every 8th row group and taking its K slices in order, a block-wide
meeting at each stage's end. Checks that no schedule deadlocks and that no unit is read after
its bytes were overwritten, for Qwen3-4B's and Qwen3-0.6B's shapes on 132 multiprocessors.

With `--stage-start-position` it uses the first version's rule (a warp reports the stage start
until it finishes a unit), which deadlocks on Qwen3-4B as the GPU did (run AL,
docs/PERFORMANCE.md). Usage: scripts/dev/ring_protocol_sim.py [--stage-start-position]
"""
import random
import sys


def ksplit(k):
    return next((s for s in (8, 4, 2, 1) if k // s >= 256), 1)


def slice_len(k, s):
    return ((k + 31) // 32 + s - 1) // s * 32


def simulate(block, blocks, shapes, layers, ring, chunk, seed, old_rule=False):
    rnd = random.Random(seed)
    stages = []
    for _ in range(layers):
        for n, k in shapes:
            ks = ksplit(k)
            groups_all = (n + 15) // 16
            groups = (groups_all - 1 - block) // blocks + 1 if groups_all > block else 0
            stages.append((groups, ks, 16 * slice_len(k, ks) * 2))
    total = sum(g * ks * ub for g, ks, ub in stages)
    slots = ring // chunk
    issued, v, stage = 0, 0, 0
    progress = [0] * 8
    state = []

    def start_stage():
        g, ks, ub = stages[stage]
        end = v + g * ks * ub
        state.clear()
        for w in range(8):
            progress[w] = v if old_rule else (v + w * ks * ub if w < g else end)
            state.append([w, 0])

    start_stage()
    while stage < len(stages):
        g, ks, ub = stages[stage]
        end = v + g * ks * ub
        if all(s[0] >= g for s in state):
            progress[:] = [end] * 8
            v, stage = end, stage + 1
            if stage < len(stages):
                start_stage()
            continue
        ready = []
        if issued * chunk < total and (issued < slots or min(progress) >= (issued - slots + 1) * chunk):
            ready.append(None)
        for w, (i, s) in enumerate(state):
            at = v + (i * ks + s) * ub
            if i < g and (at + ub - 1) // chunk < issued:
                ready.append(w)
        if not ready:
            return f"deadlock in stage {stage}"
        w = rnd.choice(ready)
        if w is None:
            issued += 1
            continue
        i, s = state[w]
        at = v + (i * ks + s) * ub
        assert at // chunk >= issued - slots, f"unit read after its bytes were overwritten (stage {stage})"
        if s + 1 < ks:
            state[w] = [i, s + 1]
            progress[w] = at + ub
        else:
            state[w] = [i + 8, 0]
            progress[w] = v + (i + 8) * ks * ub if i + 8 < g else end
    return "ok"


def main():
    old = "--stage-start-position" in sys.argv
    models = {
        "qwen3-4b": [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)],
        "qwen3-0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],
    }
    failed = False
    for name, shapes in models.items():
        for block in (0, 27, 28, 131):
            for chunk, ring in ((16384, 11 * 16384), (32768, 5 * 32768)):
                for seed in range(20):
                    result = simulate(block, 132, shapes, 2, ring, chunk, seed, old)
                    if result != "ok":
                        print(f"{name} block {block} chunk {chunk} seed {seed}: {result}")
                        failed = True
                        break
    print("deadlocks found" if failed else "no deadlock, no overwritten unit")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
