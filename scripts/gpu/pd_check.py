#!/usr/bin/env python3
"""Disaggregated serving on one GPU, as separate processes: a colocated engine (the reference),
then a prefill engine, a decode engine and the router, in push and then pull mode, all with
`--device cuda:0`. KV moves through each engine's host copy of its GPU KV cache and TCP.
Greedy answers through the router must equal the colocated engine's token for token.

Usage: pd_check.py TANDEM_BINARY OUT_DIR [MODEL]   (MODEL or $PD_MODEL, default preset:qwen3-0.6b;
$PD_DEVICE=cpu tries it without a GPU). Prints one summary line per mode; exits 1 on a mismatch
or an error. Logs: OUT_DIR/pd_*.log.
"""
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

exe, out = sys.argv[1], sys.argv[2]
model = sys.argv[3] if len(sys.argv) > 3 else os.environ.get("PD_MODEL", "preset:qwen3-0.6b")
# Explicit KV sizes: the engines share the GPU, and each sizes its cache from what is free.
device = os.environ.get("PD_DEVICE", "cuda:0")  # PD_DEVICE=cpu tries the script without a GPU
common = ["--device", device, "--model", model, "--num-kv-blocks", "1024", "--block-size", "16"]
procs = []


def start(name, args):
    log = open(os.path.join(out, f"pd_{name}.log"), "w")
    # The engines log each KV copy between the GPU cache and its host copy (its duration).
    p = subprocess.Popen([exe, "--log", "info,tandem_model=debug"] + args, stdout=log, stderr=subprocess.STDOUT)
    procs.append(p)
    return p


def post(url, body, timeout=120):
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def wait_healthy(url, secs=180):
    deadline = time.time() + secs
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} never became healthy (see {out}/pd_*.log)")


def stop_all():
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
    procs.clear()


# Prompts of 1 to 300 tokens (several KV blocks, a partial last block), greedy, fixed length.
prompts = [[(s * 31 + j * 7) % 500 + 10 for j in range(n)] for s, n in enumerate([1, 7, 16, 17, 64, 150, 300, 33])]
bodies = [{"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True} for p in prompts]
status = 0
try:
    start("colocated", ["serve", "--port", "18300"] + common)
    wait_healthy("http://127.0.0.1:18300")
    want = []
    for b in bodies:
        code, r = post("http://127.0.0.1:18300", b)
        if code != 200:
            raise RuntimeError(f"colocated answered {code}: {r}")
        want.append(r["choices"][0]["token_ids"])
    stop_all()
    for mode, base in [("push", 18400), ("pull", 18500)]:
        p, d, r = f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}", f"http://127.0.0.1:{base + 2}"
        start(f"{mode}_prefill", ["serve", "--role", "prefill", "--kv-mode", mode, "--port", str(base),
                                  "--kv-port", str(base + 50), "--kv-host-gib", "8"] + common)
        start(f"{mode}_decode", ["serve", "--role", "decode", "--kv-mode", mode, "--port", str(base + 1),
                                 "--kv-port", str(base + 51), "--kv-host-gib", "8"] + common)
        wait_healthy(p)
        wait_healthy(d)
        start(f"{mode}_router", ["router", "--mode", mode, "--prefill", p, "--decode", d, "--port", str(base + 2)])
        wait_healthy(r)
        same, errors, t0 = 0, [], time.time()
        for i, b in enumerate(bodies):
            code, ans = post(r, b)
            if code != 200:
                errors.append(f"request {i}: {code} {ans}")
            elif ans["choices"][0]["token_ids"] == want[i]:
                same += 1
            else:
                errors.append(f"request {i} ({len(b['prompt'])} prompt tokens): {ans['choices'][0]['token_ids']} "
                              f"!= colocated {want[i]}")
        secs = time.time() - t0
        copies = []
        for role in ("prefill", "decode"):
            for line in open(os.path.join(out, f"pd_{mode}_{role}.log"), errors="replace"):
                line = re.sub(r"\x1b\[[0-9;]*m", "", line)  # the log's colours
                found = re.search(r"host copy.* ms=([0-9.]+)", line)
                if found:
                    copies.append(float(found.group(1)))
        copy_note = f", host KV copies: {len(copies)}, longest {max(copies):.1f} ms" if copies else ""
        print(f"P/D on {device} ({model}), {mode}: {same}/{len(bodies)} answers equal colocated token for token, "
              f"{secs:.1f} s{copy_note}")
        for e in errors[:5]:
            print("   ", e)
        if errors:
            status = 1
        stop_all()
except Exception as e:  # a process that never came up, an unreachable port
    print(f"P/D on {device}: FAILED: {e}")
    status = 1
finally:
    stop_all()
sys.exit(status)
