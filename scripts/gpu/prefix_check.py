#!/usr/bin/env python3
"""Issue 30's measurements on one GPU, as separate processes: multi-turn chat traffic (every
conversation shares a long system prompt and resends its history each turn) against

  colocated        one engine, prefix caching on, then off (the baseline)
  pd               prefill + decode (push over cuda-ipc) + router
  pd-conditional   the same with the router's --local-prefill-max-tokens
  2p2d kv-aware    two prefill and two decode engines, the router routing by cached prefix
  2p2d round-robin the same with --kv-aware-routing off
  mixed            conditional disaggregation: short uncached prompts alone and beside long ones,
                   colocated vs pd vs pd-conditional (short TTFT, long prompts' TPOT)

reporting the median TTFT of each turn (`tandem bench serve --dataset-name multi-turn`), and
the bytes a decode engine receives for a prompt whose first 90% it holds, against a full
transfer (delta-only transfer). Prints a table last; logs under OUT_DIR.

Usage: prefix_check.py TANDEM_BINARY OUT_DIR
Environment: PREFIX_MODEL (preset:qwen3-4b), PREFIX_DEVICE (cuda:0; `cpu` tries it without a GPU),
PREFIX_SHARED (4096 shared tokens), PREFIX_CONVS (16 conversations), PREFIX_TURNS (4),
PREFIX_RATE (conversations/s, 2), PREFIX_VOCAB (100000), PREFIX_BLOCKS (--num-kv-blocks per engine, 4096),
PREFIX_ONLY (a comma list of the setups above to run, and `mixed`; default all), PREFIX_SHORT and
PREFIX_LONG (the mixed setup's prompt lengths, 256 and 8192), PREFIX_DISTINCT (1: each
conversation opens with its own PREFIX_SHARED tokens; 0: all share one system prompt).
"""
import json
import os
import subprocess
import sys
import time
import urllib.request

exe, out = sys.argv[1], sys.argv[2]
env = os.environ.get
model, device = env("PREFIX_MODEL", "preset:qwen3-4b"), env("PREFIX_DEVICE", "cuda:0")
shared, convs, turns = int(env("PREFIX_SHARED", "4096")), int(env("PREFIX_CONVS", "16")), int(env("PREFIX_TURNS", "4"))
rate, vocab, blocks = env("PREFIX_RATE", "2"), int(env("PREFIX_VOCAB", "100000")), env("PREFIX_BLOCKS", "4096")
only = [s for s in env("PREFIX_ONLY", "").split(",") if s]
# Each conversation its own opening (the default): turn 1 computes its history, later turns
# find it cached. PREFIX_DISTINCT=0: one system prompt all conversations share.
distinct = env("PREFIX_DISTINCT", "1") == "1"
# Room for the longest conversation: the shared prompt and every turn's 128 user and 64 output tokens.
common = ["--device", device, "--model", model, "--num-kv-blocks", blocks, "--max-model-len", str(shared + turns * 192 + 64)]
ipc = ["--kv-transport", "cuda-ipc"] if device != "cpu" else []
procs, rows, mixed = [], [], []
# The conditional-disaggregation setup ("mixed"): short prompts (under the router's 512-token
# --local-prefill-max-tokens) at 4/s, alone and beside long ones at 0.5/s.
mixed_short, mixed_long = int(env("PREFIX_SHORT", "256")), int(env("PREFIX_LONG", "8192"))


def start(name, args):
    log = open(os.path.join(out, f"prefix_{name}.log"), "w")
    procs.append(subprocess.Popen([exe, "--log", "warn"] + args, stdout=log, stderr=subprocess.STDOUT))


def stop_all():
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
    procs.clear()


def wait_healthy(url, secs=300):
    deadline = time.time() + secs
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} never became healthy (see {out}/prefix_*.log)")


def metric(url, name, label=None):
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name) and (label is None or f'"{label}"' in line):
                return float(line.split()[-1])
    return 0.0


def multi_turn(url, name):
    """Median TTFT per turn (ms) of the multi-turn load against `url`."""
    result = f"prefix_{name}.json"
    cmd = [exe, "bench", "serve", "--base-url", url, "--dataset-name", "multi-turn", "--multi-turn-shared-len",
           str(shared), "--multi-turn-user-len", "128", "--multi-turn-turns", str(turns), "--random-output-len", "64",
           "--random-vocab-size", str(vocab), "--num-prompts", str(convs), "--request-rate", rate, "--no-progress",
           "--save-result", "--result-dir", out, "--result-filename", result]
    if distinct:
        cmd.append("--multi-turn-distinct-openings")
    subprocess.run(cmd, check=True, stdout=open(os.path.join(out, f"prefix_{name}_bench.log"), "w"),
                   stderr=subprocess.STDOUT, timeout=400)
    j = json.load(open(os.path.join(out, result)))
    return j["median_ttft_ms_by_turn"], j.get("median_tpot_ms")


def engine(name, port, role=None, extra=(), base=None):
    args = ["serve", "--port", str(port)] + (base or common) + list(extra)
    if role:
        args += ["--role", role, "--kv-mode", "push", "--kv-port", str(port + 50)] + ipc
    start(name, args)
    return f"http://127.0.0.1:{port}"


def router(name, port, prefill, decode, extra=()):
    start(name, ["router", "--mode", "push", "--prefill", ",".join(prefill), "--decode", ",".join(decode),
                 "--port", str(port)] + list(extra))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    return url


def record(name, url):
    by_turn, tpot = multi_turn(url, name)
    rows.append((name, by_turn, tpot))
    print(f"{name}: median TTFT by turn {['%.1f' % t for t in by_turn]} ms, TPOT {tpot} ms", flush=True)


def random_load(url, name, input_len, rate, n, seed, wait=True):
    """`bench serve` of `n` random prompts; its JSON when `wait`, else the running process."""
    cmd = [exe, "bench", "serve", "--base-url", url, "--random-input-len", str(input_len), "--random-output-len", "64",
           "--random-vocab-size", str(vocab), "--num-prompts", str(n), "--request-rate", rate, "--seed", str(seed),
           "--no-progress", "--save-result", "--result-dir", out, "--result-filename", f"{name}.json"]
    proc = subprocess.Popen(cmd, stdout=open(os.path.join(out, f"{name}_bench.log"), "w"), stderr=subprocess.STDOUT)
    proc.result = os.path.join(out, f"{name}.json")
    return finish(proc) if wait else proc


def finish(proc):
    if proc.wait(timeout=300) != 0:
        raise RuntimeError(f"bench serve failed: see {proc.result[:-5]}_bench.log")
    return json.load(open(proc.result))


def want(name):
    return not only or name in only


status = 0
try:
    for caching in ["on", "off"]:
        name = f"colocated-cache-{caching}"
        if want("colocated"):
            c = engine(name, 18600, extra=["--prefix-caching", caching])
            wait_healthy(c)
            record(name, c)
            stop_all()
    for name, extra in [("pd", []), ("pd-conditional", ["--local-prefill-max-tokens", "512"])]:
        if not want(name):
            continue
        p, d = engine(f"{name}_prefill", 18610, "prefill"), engine(f"{name}_decode", 18620, "decode")
        wait_healthy(p)
        wait_healthy(d)
        r = router(f"{name}_router", 18630, [p], [d], extra)
        record(name, r)
        if name == "pd":
            # Delta-only transfer: a full prompt, then one sharing its first 90%.
            body = lambda ids: json.dumps({"prompt": ids, "max_tokens": 1, "temperature": 0}).encode()
            post = lambda ids: urllib.request.urlopen(urllib.request.Request(
                f"{r}/v1/completions", data=body(ids), headers={"Content-Type": "application/json"}), timeout=120).read()
            first = [(j * 7919) % (vocab - 3) + 2 for j in range(shared)]
            cut = shared * 9 // 10
            second = first[:cut] + [(j * 104729) % (vocab - 3) + 2 for j in range(shared - cut)]
            b0 = metric(d, "tandem:kv_connector", "bytes_received")
            post(first)
            time.sleep(0.5)
            b1 = metric(d, "tandem:kv_connector", "bytes_received")
            post(second)
            time.sleep(0.5)
            b2 = metric(d, "tandem:kv_connector", "bytes_received")
            full, delta = b1 - b0, b2 - b1
            print(f"delta transfer: {delta / 2**20:.1f} MiB for a 90% prefix hit vs {full / 2**20:.1f} MiB whole "
                  f"({100 * delta / max(full, 1):.1f}%)", flush=True)
            rows.append(("pd 90% hit bytes", [100 * delta / max(full, 1)], None))
        stop_all()
    for name, aware in [("2p2d-kv-aware", "on"), ("2p2d-round-robin", "off")]:
        if not want(name):
            continue
        ps = [engine(f"{name}_p{i}", 18640 + 10 * i, "prefill") for i in range(2)]
        ds = [engine(f"{name}_d{i}", 18660 + 10 * i, "decode") for i in range(2)]
        for u in ps + ds:
            wait_healthy(u)
        r = router(f"{name}_router", 18680, ps, ds, ["--kv-aware-routing", aware])
        record(name, r)
        hits = [metric(u, "tandem:prefix_cache_hits_total") for u in ps]
        print(f"{name}: prefill prefix-cache hits {hits}", flush=True)
        stop_all()
    # Conditional disaggregation: short prompts alone, then beside long ones, against colocated
    # (none of them cached: random prompts). Short prompts should see colocated's TTFT when the
    # router runs them on decode; long ones should keep disaggregation's TPOT.
    mixed_common = list(common)
    mixed_common[mixed_common.index("--max-model-len") + 1] = str(mixed_long + 128)
    for name, extra in [("colocated", None), ("pd", []), ("pd-conditional", ["--local-prefill-max-tokens", "512"])]:
        if not want("mixed"):
            break
        if extra is None:
            url = engine(f"mixed_{name}", 18700, base=mixed_common)
            wait_healthy(url)
        else:
            p = engine(f"mixed_{name}_prefill", 18710, "prefill", base=mixed_common)
            d = engine(f"mixed_{name}_decode", 18720, "decode", base=mixed_common)
            wait_healthy(p)
            wait_healthy(d)
            url = router(f"mixed_{name}_router", 18730, [p], [d], extra)
        alone = random_load(url, f"mixed_{name}_short_alone", mixed_short, "4", 24, 11)
        both = [random_load(url, f"mixed_{name}_short", mixed_short, "4", 32, 12, wait=False),
                random_load(url, f"mixed_{name}_long", mixed_long, "0.5", 4, 13, wait=False)]
        short, long = [finish(b) for b in both]
        mixed.append((name, alone["median_ttft_ms"], short["median_ttft_ms"], long["median_tpot_ms"]))
        print(f"mixed {name}: short TTFT alone {alone['median_ttft_ms']:.1f} ms, beside long prompts "
              f"{short['median_ttft_ms']:.1f} ms; long prompts' TPOT {long['median_tpot_ms']:.2f} ms", flush=True)
        stop_all()
except Exception as e:  # a process that never came up, a failed benchmark
    print(f"prefix check on {device}: FAILED: {e}", flush=True)
    status = 1
finally:
    stop_all()
# The figure: median TTFT by turn, one line per setup (out/ttft_by_turn.png and .svg).
subprocess.run([exe, "bench", "plot", "--results-dir", out, "--turns-only"], check=False,
               stdout=open(os.path.join(out, "prefix_plot.log"), "w"), stderr=subprocess.STDOUT)
print(f"\n{'setup':>22} {'TTFT by turn (ms)':>40} {'turn 2+ / turn 1':>16} {'TPOT ms':>8}")
for name, by_turn, tpot in rows:
    if name.endswith("bytes"):
        print(f"{name:>22} {by_turn[0]:>39.1f}% of a full transfer")
        continue
    later = sorted(by_turn[1:])[len(by_turn[1:]) // 2] if len(by_turn) > 1 else float("nan")
    cells = " / ".join(f"{t:.1f}" for t in by_turn)
    print(f"{name:>22} {cells:>40} {later / by_turn[0]:>16.2f} {tpot if tpot is not None else float('nan'):>8.2f}")
if mixed:
    base = mixed[0][1] if mixed[0][0] == "colocated" else float("nan")
    print(f"\n{'mixed traffic':>22} {'short TTFT alone':>17} {'/ colocated':>12} {'beside long':>12} "
          f"{'long TPOT':>10}   ({mixed_short}-token prompts at 4/s, {mixed_long}-token at 0.5/s)")
    for name, alone, short, tpot in mixed:
        print(f"{name:>22} {alone:>14.1f} ms {alone / base:>12.3f} {short:>9.1f} ms {tpot:>7.2f} ms")
sys.exit(status)
