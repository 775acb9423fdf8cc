#!/usr/bin/env python3
"""Where a push's wait after prefill's hand-over goes, per sweep point (median ms over the
point's requests), from the decode engine's per-request timelines in a `bench sweep` result
folder:

  handover->ready  prefill hands the KV over -> decode's engine applies it (wall clocks, one host)
  backlog          of it, prefill's writer still sending what earlier steps computed
  tail             the rest before decode's last write ended: the last write(s) and their landing
  done             decode's last write ended -> prefill's `Done` made it ready (connector)
  apply            the connector's `Ready` -> the engine applied it (a step in flight finishing)

With --log SWEEP_LOG (a sweep run with `--engine-log warn,tandem_kv=debug`), also each layer
group's way from its fence to decode, per point, in ms from the hand-over (median over the
point's transfers): computed (prefill's writer saw the group's fence), sent (its bytes all in
prefill's sockets), announced and landed (decode began reading it; its bytes are in the device
cache). A group merged with the next one shows as their union.

usage: push_tail.py RESULT_DIR [--log SWEEP_LOG]
"""
import glob
import json
import os
import re
import statistics
import sys
from collections import defaultdict
from datetime import datetime

LINE = re.compile(r"^\[\s*(prefill|decode)\] (\S+)Z DEBUG .*?: (KV group \w+|KV handed over)(?: layers=(\d+\.\.\d+))?")
TRANSFER = re.compile(r"transfer_id=([^}\s]+)")
PROGRESS = re.compile(r"^\s+push qps\s+(\S+) in\s+(\d+) iter")


def main(result_dir):
    print(f"{'point':>24} {'n':>3} {'handover->ready':>15} {'backlog':>8} {'tail':>6} {'done':>6} {'apply':>6}")
    for path in sorted(glob.glob(os.path.join(result_dir, "push_*.json"))):
        rows = []
        for t in json.load(open(path)).get("kv_timelines") or []:
            if not t or t.get("produced_to_ready_us") is None:
                continue
            tr = t["transfer"]
            apply = t["ready_us"] - t["queued_us"] - tr["ready_us"]
            done = tr["ready_us"] - tr["data_end_us"]
            backlog = tr.get("handover_backlog_us", 0)
            whole = t["produced_to_ready_us"]
            rows.append((whole, backlog, whole - backlog - done - apply, done, apply))
        if not rows:
            continue
        med = [statistics.median(c) / 1000 for c in zip(*rows)]
        name = os.path.basename(path)[len("push_"):-len(".json")]
        print(f"{name:>24} {len(rows):>3} {med[0]:>15.2f} {med[1]:>8.2f} {med[2]:>6.2f} {med[3]:>6.2f} {med[4]:>6.2f}")


def groups(log):
    """Per sweep point (in the log's order), each transfer's events: {(event, layers): seconds}."""
    points, transfers = [], defaultdict(dict)
    for line in open(log, errors="replace"):
        m = PROGRESS.match(line)
        if m:
            points.append((f"qps{m[1]}_in{m[2]}", transfers))
            transfers = defaultdict(dict)
            continue
        m = LINE.match(line)
        if not m:
            continue
        t = datetime.fromisoformat(m[2]).timestamp()
        event = m[3].replace("KV group ", "")
        transfers[TRANSFER.search(line)[1]].setdefault((event, m[4]), t)
    return points


def main_log(log):
    order = ["computed", "sent", "announced", "landed"]
    for point, transfers in groups(log):
        rel = defaultdict(list)
        for events in transfers.values():
            handover = events.get(("KV handed over", None))
            if handover is None:
                continue
            for (event, layers), t in events.items():
                if layers is not None:
                    rel[layers, event].append((t - handover) * 1000)
        layer_sets = sorted({l for l, _ in rel}, key=lambda l: [int(x) for x in l.split("..")])
        print(f"\n{point}: {len(transfers)} transfers, ms from the hand-over (median)")
        print(f"{'layers':>8} {'n':>3} " + " ".join(f"{e:>9}" for e in order))
        for l in layer_sets:
            n = max(len(rel[l, e]) for e in order)
            cells = [f"{statistics.median(rel[l, e]):>9.2f}" if rel[l, e] else f"{'':>9}" for e in order]
            print(f"{l:>8} {n:>3} " + " ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1])
    if "--log" in sys.argv:
        main_log(sys.argv[sys.argv.index("--log") + 1])
