"""Summarises an Nsight Compute CSV (`ncu --csv --page details --print-units base`) per kernel.

Used by `scripts/gpu/run.sh ncu`: one row per (kernel, grid, block) with the number of launches
profiled and the mean of the metrics that say where a memory-bound kernel's time goes: its
duration, DRAM throughput (percent of peak and GB/s), achieved occupancy, L1 and L2 hit rates,
cycles per issued instruction, and its three largest warp stall reasons (cycles per issued
instruction, from the smsp__average_warps_issue_stalled_* metrics when collected).
Usage: python3 ncu_table.py NCU_CSV
"""
import csv
import sys
from collections import defaultdict

# (column title, metric names as Nsight Compute versions spell them)
WANTED = [
    ("us", ["Duration"]),
    ("DRAM %", ["DRAM Throughput"]),
    ("GB/s", ["DRAM Bandwidth", "dram__bytes.sum.per_second"]),
    ("occ %", ["Achieved Occupancy"]),
    ("L1 hit %", ["L1/TEX Hit Rate"]),
    ("L2 hit %", ["L2 Hit Rate"]),
    ("cyc/issue", ["Warp Cycles Per Issued Instruction"]),
    ("regs", ["Registers Per Thread"]),
]
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def main(path):
    # Nsight Compute prints its own log lines (==PROF== ...) before the CSV header.
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    rows = list(csv.DictReader(lines))
    if not rows:
        print(f"{path}: no profiled kernels (see the .err file beside it)")
        return
    # launch ID -> metrics; kernel key per launch
    launches = defaultdict(dict)
    key_of = {}
    for row in rows:
        launch = row.get("ID")
        key_of[launch] = (row.get("Kernel Name", "?").split("(")[0], row.get("Grid Size", ""), row.get("Block Size", ""))
        value = number(row.get("Metric Value", ""))
        if value is not None:
            unit = row.get("Metric Unit", "")
            name = row.get("Metric Name", "")
            # Durations in microseconds and bandwidths in GB/s whatever unit ncu printed.
            scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "byte/second": 1e-9,
                     "Kbyte/second": 1e-6, "Mbyte/second": 1e-3, "Gbyte/second": 1.0, "Tbyte/second": 1e3}
            launches[launch][name] = value * scale.get(unit, 1.0)
    groups = defaultdict(list)
    for launch, metrics in launches.items():
        groups[key_of[launch]].append(metrics)
    titles = [t for t, _ in WANTED]
    print(f"{'kernel':<34}{'grid':>16}{'n':>4}" + "".join(f"{t:>10}" for t in titles) + "  top stalls (cycles/issue)")
    for (name, grid, block), members in sorted(groups.items(), key=lambda kv: -sum(m.get("Duration", 0) for m in kv[1])):
        cells = []
        for _, names in WANTED:
            vals = [m[n] for m in members for n in names if n in m]
            cells.append(f"{sum(vals) / len(vals):>10.1f}" if vals else f"{'-':>10}")
        stalls = defaultdict(list)
        for m in members:
            for metric, v in m.items():
                if metric.startswith(STALL_PREFIX) and metric.endswith(STALL_SUFFIX):
                    stalls[metric[len(STALL_PREFIX):-len(STALL_SUFFIX)]].append(v)
        top = sorted(((sum(v) / len(v), k) for k, v in stalls.items()), reverse=True)[:3]
        print(f"{name[:34]:<34}{grid[:16]:>16}{len(members):>4}" + "".join(cells) + "  "
              + ", ".join(f"{k} {v:.1f}" for v, k in top))


if __name__ == "__main__":
    main(sys.argv[1])
