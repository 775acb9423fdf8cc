#!/usr/bin/env python3
"""A network partition between the prefill host and the decode host, under load.

Run by `CHECK=partition scripts/two_hosts.sh TANDEM OUT` (which makes the two network namespaces):
per setting (push and pull; tcp, and NIXL with NIXL=1), a colocated engine answers a pool of
prompts first (the reference), then prefill (in tandem-p), decode (in tandem-d) and a router
take 8 clients' load for PARTITION_SECS*3 seconds; a third of the way in, every packet between
the two engines' hosts is dropped (a blackhole route each way: no reset, no ICMP, as a failed
switch would), and two thirds in the routes go again. The router and the clients reach both
engines throughout. Checks: no answer differs from colocated (decode recomputes what it could
not load), no request goes unanswered past 60 s, requests after the heal all succeed and KV
moves over the link again, and both engines' KV blocks come back to baseline. One summary
line per setting; exits 1 on a failed check. Logs: OUT/partition_*.log.

Usage: partition_check.py TANDEM_BINARY OUT_DIR [MODEL]
"""
import concurrent.futures
import os
import random
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
import engine_http  # noqa: E402  (beside pd_check.py)
from engine_http import metric  # noqa: E402

exe, out = sys.argv[1], sys.argv[2]
model = sys.argv[3] if len(sys.argv) > 3 else "preset:tiny-qwen3"
phase = float(os.environ.get("PARTITION_SECS", "5"))
P, D = ("tandem-p", "10.77.0.1"), ("tandem-d", "10.77.0.2")
vocab = int(os.environ.get("PD_VOCAB", "256"))
# Engines notice a silent peer within --kv-liveness-secs (a heartbeat every third of it).
engine_args = ["--model", model, "--num-kv-blocks", "2048", "--kv-liveness-secs", "2",
               "--kv-transfer-timeout-secs", "10", "--kv-nixl-min-gb-s", "0.1"]
procs = []


def start(name, args, ns=None):
    log = open(os.path.join(out, f"partition_{name}.log"), "w")
    prefix = ["ip", "netns", "exec", ns] if ns else []
    procs.append(subprocess.Popen(prefix + [exe] + args, stdout=log, stderr=subprocess.STDOUT))


def stop_all():
    engine_http.stop_all(procs)


def post(url, body):
    """A completion's (status, answer); (None, why) for one unanswered within 60 s."""
    try:
        return engine_http.post(url, body, timeout=60)
    except Exception as e:
        return None, str(e)


def wait_healthy(url):
    engine_http.wait_healthy(url, f"{out}/partition_*.log", 120)


def partition(on, check=True):
    """Drops (or stops dropping) every packet between the two engines' hosts."""
    verb = "add" if on else "del"
    for (ns, _), (_, peer) in ((P, D), (D, P)):
        subprocess.run(["ip", "-n", ns, "route", verb, "blackhole", f"{peer}/32"], check=check,
                       stderr=None if check else subprocess.DEVNULL)


rng = random.Random(7)
pool = [{"prompt": [rng.randrange(10, vocab) for _ in range(rng.randrange(20, 400))], "max_tokens": 8,
         "temperature": 0, "ignore_eos": True} for _ in range(40)]
settings = [("push", "tcp"), ("pull", "tcp")]
if os.environ.get("NIXL") == "1":
    settings += [("push", "nixl"), ("pull", "nixl")]
# PARTITION_SETTINGS=pull_tcp (or any text in the setting's name; several, comma-separated).
keep = os.environ.get("PARTITION_SETTINGS", "").split(",")
settings = [s for s in settings if any(k in "_".join(s) for k in keep)]
status = 0
try:
    start("colocated", ["serve", "--port", "18300"] + engine_args)
    c = "http://127.0.0.1:18300"
    wait_healthy(c)
    want = []
    for b in pool:
        code, r = post(c, b)
        if code != 200:
            raise RuntimeError(f"colocated answered {code}: {r}")
        want.append(r["choices"][0]["token_ids"])
    stop_all()
    for n, (mode, transport) in enumerate(settings):
        base = 18400 + 100 * n
        name = f"{mode}_{transport}"
        p, d, r = f"http://{P[1]}:{base}", f"http://{D[1]}:{base + 1}", f"http://127.0.0.1:{base + 2}"
        kv = ["--kv-mode", mode, "--kv-transport", transport, "--kv-host", "0.0.0.0"]
        start(f"{name}_prefill", ["serve", "--role", "prefill", "--host", P[1], "--port", str(base),
                                  "--kv-port", str(base + 50)] + kv + engine_args, P[0])
        start(f"{name}_decode", ["serve", "--role", "decode", "--host", D[1], "--port", str(base + 1),
                                 "--kv-port", str(base + 51)] + kv + engine_args, D[0])
        wait_healthy(p)
        wait_healthy(d)
        start(f"{name}_router", ["router", "--mode", mode, "--prefill", p, "--decode", d, "--port", str(base + 2)])
        wait_healthy(r)
        errors, results, lock = [], [], threading.Lock()
        t0 = time.time()
        stop_at = t0 + 3 * phase

        def client(seed):
            local = random.Random(seed)
            while time.time() < stop_at:
                i = local.randrange(len(pool))
                sent = time.time()
                code, ans = post(r, pool[i])
                with lock:
                    results.append((sent - t0, time.time() - sent, i, code, ans))

        with concurrent.futures.ThreadPoolExecutor(8) as clients:
            running = [clients.submit(client, s) for s in range(8)]
            time.sleep(phase)
            partition(True)
            time.sleep(phase)
            partition(False)
            for f in running:
                f.result()
        ok = [x for x in results if x[3] == 200]
        wrong = [x for x in ok if x[4]["choices"][0]["token_ids"] != want[x[2]]]
        lost = [x for x in results if x[3] is None]
        failed = [x for x in results if x[3] not in (200, None)]
        worst = max((x[1] for x in results), default=0.0)
        # After the heal: every request answers, as colocated does, and KV crosses the link.
        moved_before = metric(d, "tandem:kv_connector", "transfers_ok") or 0
        after = [post(r, b) for b in pool[:8]]
        after_ok = sum(code == 200 and a["choices"][0]["token_ids"] == w for (code, a), w in zip(after, want))
        moved = (metric(d, "tandem:kv_connector", "transfers_ok") or 0) - moved_before
        # Blocks back: a direct write cut off by the partition keeps its blocks one I/O timeout
        # (30 s) after it failed, in case the write still lands.
        deadline, leaks = time.time() + 45, ["not checked"]
        while time.time() < deadline and leaks:
            leaks = [f"{role} {metric(u, 'tandem:kv_blocks_free'):.0f}/{metric(u, 'tandem:kv_blocks_total'):.0f}"
                     for role, u in (("prefill", p), ("decode", d))
                     if metric(u, "tandem:kv_blocks_free") != metric(u, "tandem:kv_blocks_total")]
            time.sleep(0.5)
        held_secs = time.time() - (deadline - 45)
        if wrong:
            errors.append(f"{len(wrong)} answers differ from colocated")
        if lost:
            errors.append(f"{len(lost)} requests unanswered after 60 s: {lost[0][4]}")
        if after_ok != len(after):
            errors.append(f"after the heal {len(after) - after_ok} of {len(after)} requests failed: "
                          f"{[a for code, a in after if code != 200][:1]}")
        if moved < 1:
            errors.append("after the heal no KV crossed the link (every request recomputed)")
        if leaks:
            errors.append("KV blocks not back to baseline: " + ", ".join(leaks))
        recomputed = metric(d, "tandem:kv_connector", "transfers_failed")
        print(f"partition {phase:.0f} s, {name}: {len(results)} requests, {len(ok)} ok, {len(failed)} failed "
              f"(clear errors), {len(wrong)} wrong, {len(lost)} unanswered; slowest {worst:.1f} s; "
              f"{recomputed:.0f} transfers failed at decode (recomputed); after the heal {after_ok}/{len(after)} "
              f"equal colocated, {moved:.0f} over the link; blocks back {'after %.1f s' % held_secs if not leaks else 'NO'}")
        for x in sorted(results, key=lambda x: -x[1])[:3]:
            print(f"    slow: sent {x[0] - phase:+.1f} s from the cut, took {x[1]:.1f} s, answered {x[3]}")
        for f in failed[:2]:
            print(f"    failed: {f[3]} {str(f[4])[:200]}")
        for e in errors:
            print("   ", e)
        if errors:
            status = 1
        stop_all()
except Exception as e:
    print(f"partition check: FAILED: {e}")
    status = 1
finally:
    stop_all()
    partition(False, check=False)
sys.exit(status)
