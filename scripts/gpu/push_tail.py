#!/usr/bin/env python3
"""Where a push's wait after prefill's hand-over goes, per sweep point (median ms over the
point's requests), from the decode engine's per-request timelines in a `bench sweep` result
folder:

  handover->ready  prefill hands the KV over -> decode's engine applies it (wall clocks, one host)
  backlog          of it, prefill's writer still sending what earlier steps computed
  tail             the rest before decode's last write ended: the last write(s) and their landing
  done             decode's last write ended -> prefill's `Done` made it ready (connector)
  apply            the connector's `Ready` -> the engine applied it (a step in flight finishing)

With --log SWEEP_LOG (a sweep run with `--engine-log warn,tandem_kv=debug`), also each write's
way from its fence to decode for the point's median transfer, in ms from the hand-over:
computed (prefill's writer saw the group's fence and queued its copies), sent (its bytes all in
prefill's sockets), announced and landed (decode began reading it; its bytes are in the device
cache). Groups merged into one write show as their union.

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
    """Per sweep point (in the log's order), each transfer's events in order: [(event, layers, s)]."""
    points, transfers = [], defaultdict(list)
    for line in open(log, errors="replace"):
        m = PROGRESS.match(line)
        if m:
            points.append((f"qps{m[1]}_in{m[2]}", transfers))
            transfers = defaultdict(list)
            continue
        m = LINE.match(line)
        if m:
            t = datetime.fromisoformat(m[2]).timestamp()
            transfers[TRANSFER.search(line)[1]].append((m[3].replace("KV group ", ""), m[4], t))
    return points


def writes(events):
    """A transfer's writes in order, each {event: ms from the hand-over} with its layers: the
    n-th computed, sent, announced and landed are the n-th write's (both ends go in order)."""
    handover = next((t for e, _, t in events if e == "KV handed over"), None)
    if handover is None:
        return None
    by_event = defaultdict(list)
    for e, layers, t in events:
        if layers is not None:
            by_event[e].append((layers, (t - handover) * 1000))
    n = max((len(v) for v in by_event.values()), default=0)
    rows = []
    for i in range(n):
        row = {e: v[i][1] for e, v in by_event.items() if i < len(v)}
        row["layers"] = next(v[i][0] for v in by_event.values() if i < len(v))
        rows.append(row)
    return rows


def main_log(log):
    """Each point's transfers by when their last write landed, and the median one write by write."""
    order = ["computed", "sent", "announced", "landed"]
    for point, transfers in groups(log):
        done = []
        for tid, events in transfers.items():
            rows = writes(events)
            if rows:
                done.append((max(r.get("landed", float("-inf")) for r in rows), tid, rows))
        if not done:
            continue
        done.sort()
        print(f"\n{point}: last write landed, ms after the hand-over, per transfer: "
              + " ".join(f"{d:.1f}" for d, _, _ in done))
        last, tid, rows = done[len(done) // 2]
        print(f"the median ({tid}), write by write:")
        print(f"{'layers':>8} " + " ".join(f"{e:>9}" for e in order))
        for r in rows:
            print(f"{r['layers']:>8} " + " ".join(f"{r[e]:>9.2f}" if e in r else f"{'':>9}" for e in order))


if __name__ == "__main__":
    main(sys.argv[1])
    if "--log" in sys.argv:
        main_log(sys.argv[sys.argv.index("--log") + 1])
