#!/usr/bin/env python3
"""Engines across hosts found through etcd, under load and churn (issue 52): two prefill and two
decode engines in network namespaces of their own (scripts/discovery_hosts.sh makes them), etcd
and two routers outside, every router told nothing but --discovery. Clients send greedy requests
(half of them streamed) through both routers the whole time, each answer checked against a colocated engine's; meanwhile
a third decode engine starts (it must take requests within 2 s of registering), one decode
engine stops gracefully, one prefill and one decode engine are killed (-9) and started again.
With DISC_ETCD_PID, etcd is then stopped (SIGSTOP: it answers nothing) for DISC_ETCD_PAUSE
seconds (30) under the same load, and started again. Passes when no request failed or was
wrong, the routers list the engines that are up (again within a lease after etcd's pause), and
every engine's KV blocks are back. Writes OUT_DIR/discovery_check.json and prints a table.

With DISC_SOAK_SECS=N it soaks instead: clients stream their requests for N seconds, the first
DISC_STEADY_SECS (60) steady, then a decode engine joins or leaves (gracefully) every 30 s; it
passes when no request failed or was wrong, blocks came back, and the p99 time to first token
during the churn is at most twice the steady one.

Usage: discovery_check.py TANDEM_BINARY OUT_DIR ETCD_URL
Env: DISC_HOSTS "ns:ip,..." (five: prefill, prefill, decode, decode, the decode that joins),
     DISC_CLIENTS (4), DISC_LEASE (2 s), DISC_SOAK_SECS, DISC_STEADY_SECS.
"""
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

exe, out, etcd = sys.argv[1], sys.argv[2], sys.argv[3]
hosts = [h.split(":") for h in os.environ["DISC_HOSTS"].split(",")]
clients = int(os.environ.get("DISC_CLIENTS", "4"))
lease = os.environ.get("DISC_LEASE", "2")
prefix = f"/churn{os.getpid()}"
os.makedirs(out, exist_ok=True)
procs = {}


def start(name, args, netns=None):
    log = open(os.path.join(out, f"{name}.log"), "a")
    cmd = ([ "ip", "netns", "exec", netns] if netns else []) + [exe, "--log", "info"] + args
    procs[name] = subprocess.Popen(cmd, stdout=log, stderr=log)


def http(url, body=None, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except Exception as e:  # connection refused, reset, timeout
        return 0, repr(e)


def until(what, cond, bound):
    deadline = time.time() + bound
    while not cond():
        if time.time() > deadline:
            raise SystemExit(f"FAILED: {what} not within {bound} s")
        time.sleep(0.1)


def stream(url, body):
    """A streamed completion: (status, token ids, seconds to the first token)."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"content-type": "application/json"})
    t0, first, ids = time.time(), None, []
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return 500, ids, None
                got = chunk["choices"][0].get("token_ids") or []
                if got and first is None:
                    first = time.time() - t0
                ids += got
        return 200, ids, first
    except urllib.error.HTTPError as e:
        return e.code, ids, None
    except Exception:
        return 0, ids, None


def metric(url, name):
    status, text = http(f"{url}/metrics", timeout=5)
    if status != 200:
        return None
    vals = [float(l.split()[-1]) for l in text.splitlines() if l.startswith(name + " ") or l.startswith(name + "{")]
    return sum(vals) if vals else None


engine = ["--served-model-name", "tandem", "--discovery", etcd, "--discovery-prefix", prefix, "--discovery-lease-secs", lease,
          "--max-num-batched-tokens", "64", "--kv-verify", "--shutdown-timeout-secs", "20"]
roles = ["prefill", "prefill", "decode", "decode", "decode"]


def start_engine(i):
    ns, ip = hosts[i]
    start(f"e{i}", ["serve", "--role", roles[i], "--kv-mode", "push", "--host", "0.0.0.0", "--port", "8300",
                    "--kv-host", "0.0.0.0", "--kv-port", "5700"] + engine, netns=ns)


def url(i):
    return f"http://{hosts[i][1]}:8300"


def listed(router):
    status, text = http(f"{router}/admin/engines", timeout=5)
    if status != 200:
        return None
    v = json.loads(text)
    return sorted(e["url"] for e in v["prefill"]), sorted(e["url"] for e in v["decode"])


routers = ["http://127.0.0.1:8391", "http://127.0.0.1:8392"]
status = 1
try:
    start("colocated", ["serve", "--port", "8390", "--max-num-batched-tokens", "64", "--served-model-name", "tandem"])
    for i in range(4):
        start_engine(i)
    for j, r in enumerate(routers):
        start(f"router{j}", ["router", "--mode", "push", "--port", r.rsplit(":", 1)[1], "--discovery", etcd,
                             "--discovery-prefix", prefix, "--check-interval-secs", "0.5"])
    until("the colocated engine", lambda: http("http://127.0.0.1:8390/health", timeout=2)[0] == 200, 60)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 250) for _ in range(rng.choice([5, 40, 120, 300]))] for _ in range(24)]
    body = lambda p: {"model": "tandem", "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    want = []
    for p in prompts:
        s, text = http("http://127.0.0.1:8390/v1/completions", body(p))
        assert s == 200, text
        want.append(json.loads(text)["choices"][0]["token_ids"])
    first = (sorted([url(0), url(1)]), sorted([url(2), url(3)]))
    for r in routers:
        until(f"{r} listing the four engines", lambda: listed(r) == first, 90)

    results, stop = [], threading.Event()
    if os.environ.get("DISC_SOAK_SECS"):
        soak_secs, steady_secs = float(os.environ["DISC_SOAK_SECS"]), float(os.environ.get("DISC_STEADY_SECS", "60"))
        churning = threading.Event()

        def streamer(k):
            n = k
            while not stop.is_set():
                i = n % len(prompts)
                s, ids, ttft = stream(f"{routers[n % 2]}/v1/completions", body(prompts[i]))
                results.append({"status": s, "ok": ids == want[i], "ttft": ttft, "churn": churning.is_set()})
                n += clients

        threads = [threading.Thread(target=streamer, args=(k,)) for k in range(clients)]
        began = time.time()
        for t in threads:
            t.start()
        time.sleep(steady_secs)
        churning.set()
        up, events = False, 0
        while time.time() - began < soak_secs:
            if up:
                procs["e4"].send_signal(signal.SIGINT)
                procs["e4"].wait(30)
            else:
                start_engine(4)
            up, events = not up, events + 1
            time.sleep(min(30, max(0, soak_secs - (time.time() - began))))
        stop.set()
        for t in threads:
            t.join()
        live = [0, 1, 2, 3] + ([4] if up else [])
        for i in live:
            until(f"engine {i}'s KV blocks back", lambda: metric(url(i), "tandem:kv_blocks_used") == 0.0, 30)
        p99 = lambda xs: sorted(xs)[max(0, int(len(xs) * 0.99) - 1)] if xs else float("nan")
        steady = [r["ttft"] for r in results if not r["churn"] and r["ttft"] is not None]
        churn = [r["ttft"] for r in results if r["churn"] and r["ttft"] is not None]
        failed = [r for r in results if r["status"] != 200]
        wrong = [r for r in results if r["status"] == 200 and not r["ok"]]
        summary = {"requests": len(results), "failed": len(failed), "wrong": len(wrong), "churn_events": events,
                   "p99_ttft_steady_ms": round(p99(steady) * 1000, 1), "p99_ttft_churn_ms": round(p99(churn) * 1000, 1)}
        json.dump(summary, open(os.path.join(out, "discovery_soak.json"), "w"), indent=1)
        print(json.dumps(summary))
        ok = not failed and not wrong and p99(churn) <= 2 * p99(steady)
        print("discovery soak:", "passed" if ok else "FAILED")
        status = 0 if ok else 1
        raise SystemExit(status)

    def client(k):
        # Half the clients stream: a streamed answer whose decode engine is killed mid-way is
        # resumed by the router, one that is not is tried again whole.
        n = k
        while not stop.is_set():
            i = n % len(prompts)
            t0 = time.time()
            if k % 2:
                s, got, _ = stream(f"{routers[n % 2]}/v1/completions", body(prompts[i]))
                text = "the stream ended with an error" if s != 200 else ""
            else:
                s, text = http(f"{routers[n % 2]}/v1/completions", body(prompts[i]))
                got = json.loads(text)["choices"][0]["token_ids"] if s == 200 else None
            results.append({"t": t0, "status": s, "ok": got == want[i], "streamed": bool(k % 2),
                            "error": None if s == 200 else text[:300]})
            n += clients

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    began = time.time()
    for t in threads:
        t.start()
    events = {}
    time.sleep(3)
    start_engine(4)
    until("the joining decode engine healthy", lambda: http(f"{url(4)}/health", timeout=2)[0] == 200, 60)
    healthy = time.time()
    until("the joining decode engine taking requests",
          lambda: (metric(url(4), "tandem:request_success_total") or 0) > 0, 10)
    events["joined_to_first_request_s"] = round(time.time() - healthy, 2)
    time.sleep(2)
    procs["e2"].send_signal(signal.SIGINT)
    events["graceful_stop_exit"] = procs["e2"].wait(30)
    time.sleep(2)
    for i in (0, 3):
        procs[f"e{i}"].kill()
        procs[f"e{i}"].wait()
    killed = time.time()
    after = (sorted([url(1)]), sorted([url(4)]))
    until("the routers dropping the killed engines", lambda: all(listed(r) == after for r in routers), 10)
    events["killed_to_out_of_rotation_s"] = round(time.time() - killed, 2)
    time.sleep(1)
    for i in (0, 3):
        start_engine(i)
    last = (sorted([url(0), url(1)]), sorted([url(3), url(4)]))
    until("the restarted engines back in the routers", lambda: all(listed(r) == last for r in routers), 90)
    time.sleep(3)
    if os.environ.get("DISC_ETCD_PID"):
        etcd_pid = int(os.environ["DISC_ETCD_PID"])
        os.kill(etcd_pid, signal.SIGSTOP)
        time.sleep(float(os.environ.get("DISC_ETCD_PAUSE", "30")))
        os.kill(etcd_pid, signal.SIGCONT)
        resumed = time.time()
        time.sleep(0.5)
        until("the routers' view after etcd's pause", lambda: all(listed(r) == last for r in routers), 30)
        events["etcd_paused_s"] = float(os.environ.get("DISC_ETCD_PAUSE", "30"))
        events["etcd_back_to_converged_s"] = round(time.time() - resumed, 2)
        time.sleep(3)
    stop.set()
    for t in threads:
        t.join()
    # Blocks back on every engine that is up.
    for i in (0, 1, 3, 4):
        until(f"engine {i}'s KV blocks back", lambda: metric(url(i), "tandem:kv_blocks_used") == 0.0, 30)
    failed = [r for r in results if r["status"] != 200]
    wrong = [r for r in results if r["status"] == 200 and not r["ok"]]
    summary = {"requests": len(results), "failed": len(failed), "wrong": len(wrong),
               "seconds": round(time.time() - began, 1), **events, "first_failures": failed[:5]}
    json.dump(summary, open(os.path.join(out, "discovery_check.json"), "w"), indent=1)
    print(f"{'requests':>10} {'failed':>7} {'wrong':>6} {'join->req s':>12} {'kill->out s':>12} {'etcd back->same s':>18}")
    print(f"{len(results):>10} {len(failed):>7} {len(wrong):>6} {events['joined_to_first_request_s']:>12} "
          f"{events['killed_to_out_of_rotation_s']:>12} {events.get('etcd_back_to_converged_s', '-'):>18}")
    for f in failed[:5]:
        print("failed:", f)
    ok = not failed and not wrong and events["joined_to_first_request_s"] <= 2.0 and events["graceful_stop_exit"] == 0
    status = 0 if ok else 1
    print("discovery check:", "passed" if ok else "FAILED")
finally:
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
sys.exit(status)
