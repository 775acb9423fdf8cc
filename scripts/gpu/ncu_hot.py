#!/usr/bin/env python3
"""Where one kernel's warps spend their time, from Nsight Compute's source page
(`ncu --section SourceCounters --page source --print-source sass --csv`): the SASS basic
blocks (runs of instructions executed equally often) with the most warp stall samples, each
with its share of the samples and of the executed instructions and its commonest opcodes, then
the single hottest instructions. Usage: ncu_hot.py FILE.csv [TOP]"""
import csv
import sys
from collections import Counter

path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20
lines = open(path, errors="replace").read().splitlines()
start = next((i for i, l in enumerate(lines) if l.startswith('"') and '"Source"' in l), None)
if start is None:
    sys.exit(f"no source table in {path}")
rows = list(csv.reader(lines[start:]))
header, body = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
col = {name: i for i, name in enumerate(header)}
samples_col = next((i for i, h in enumerate(header) if h.startswith("Warp Stall Sampling (All")), None)
executed_col = col.get("Instructions Executed")
if samples_col is None or executed_col is None:
    sys.exit("the table has no warp stall sampling or executed-instruction column")


def num(s):
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(source):
    words = source.split()
    words = words[1:] if words and words[0].startswith("@") else words
    return words[0].split(".")[0] if words else "?"


samples = [num(r[samples_col]) for r in body]
executed = [num(r[executed_col]) for r in body]
total_samples, total_executed = sum(samples) or 1.0, sum(executed) or 1.0
blocks = []
for i, r in enumerate(body):
    if blocks and executed[blocks[-1][-1]] == executed[i]:
        blocks[-1].append(i)
    else:
        blocks.append([i])
print(f"{len(body)} instructions, {total_samples:.0f} stall samples, {total_executed:.3g} warp instructions executed")
print(f"{'stall %':>7} {'exec %':>6} {'instrs':>6} {'times':>10}  address  opcodes")
for b in sorted(blocks, key=lambda b: -sum(samples[i] for i in b))[:top]:
    ops = Counter(opcode(body[i][col["Source"]]) for i in b).most_common(5)
    print(
        f"{100 * sum(samples[i] for i in b) / total_samples:7.1f} {100 * executed[b[0]] * len(b) / total_executed:6.1f}"
        f" {len(b):6d} {executed[b[0]]:10.0f}  {body[b[0]][0][-6:]}  " + " ".join(f"{o}x{n}" for o, n in ops)
    )
print("hottest instructions:")
for i in sorted(range(len(body)), key=lambda i: -samples[i])[:top]:
    print(f"{100 * samples[i] / total_samples:7.2f}%  {body[i][0][-6:]}  {body[i][col['Source']][:90]}")
