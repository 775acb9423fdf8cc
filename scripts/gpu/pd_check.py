#!/usr/bin/env python3
"""Disaggregated serving on one GPU, as separate processes: a colocated engine (the reference),
then a prefill engine, a decode engine and the router per setting (push and pull; KV over tcp,
through each engine's host copy of its GPU KV cache, and over cuda-ipc, device to device, also
with different block sizes on the two engines), all with `--device cuda:0`. Greedy answers
through the router must equal the colocated engine's token for token (8 prompts one at a time, two
with log-probabilities, which must agree within LOGPROB_TOLERANCE; $PD_ENGINE_ARGS adds arguments to
both engines);
then 50 mixed-length requests at once (equality reported; required with PD_BATCH_INVARIANT=1,
where every engine runs --batch-invariant), after which both engines' KV blocks must be back to all free; then the time to
the first token of a 4000-token prompt, median of 3, against colocated.

Usage: pd_check.py TANDEM_BINARY OUT_DIR [MODEL]   (MODEL or $PD_MODEL, default preset:qwen3-0.6b;
$PD_DEVICE=cpu tries it without a GPU, tcp settings only; $PD_KV_DTYPE=fp8 gives every engine an FP8 KV
cache; $PD_SETTINGS=tcp keeps the settings whose name has
"tcp"; $PD_NIXL=1 adds push and pull over NIXL, for a tandem built with --features nixl;
$PD_PUSH_OVER_PULL=R fails the run unless push's long-prompt TTFT past colocated's is at most R
times pull's (for settings both ran with); $PD_HOSTS=NS:ADDR,NS:ADDR runs the prefill engine in the first network namespace and the decode
engine in the second, listening on those addresses, as scripts/two_hosts.sh sets up). Prints one
summary line per setting;
exits 1 on a mismatch, a leak or an error. Logs: OUT_DIR/pd_*.log.
"""
import concurrent.futures
import itertools
import json
import os
import subprocess
import sys
import time

import engine_http
from engine_http import metric, post

exe, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
model = sys.argv[3] if len(sys.argv) > 3 else os.environ.get("PD_MODEL", "preset:qwen3-0.6b")
# Explicit KV sizes: the engines share the GPU, and each sizes its cache from what is free.
device = os.environ.get("PD_DEVICE", "cuda:0")  # PD_DEVICE=cpu tries the script without a GPU
common = ["--device", device, "--model", model, "--num-kv-blocks", "4096"]
# PD_BATCH_INVARIANT=1: every engine with --batch-invariant, and then the burst's answers must
# equal the colocated engine's one at a time too (any difference is a KV fault, not batching).
invariant = os.environ.get("PD_BATCH_INVARIANT") == "1"
if invariant:
    common.append("--batch-invariant")
# PD_KV_DTYPE=fp8: every engine, the colocated one too, with --kv-cache-dtype fp8 (the KV moves
# as its e4m3 bytes, half of bf16's).
if os.environ.get("PD_KV_DTYPE"):
    common += ["--kv-cache-dtype", os.environ["PD_KV_DTYPE"]]
# PD_ENGINE_ARGS: more arguments for the prefill and decode engines (split on spaces).
engine_args = os.environ.get("PD_ENGINE_ARGS", "").split()
procs = []
# PD_HOSTS: prefill and decode as two hosts (network namespaces), each reached at its own address;
# the colocated engine, the router and this script stay in the caller's namespace.
hosts = [h.split(":") for h in os.environ.get("PD_HOSTS", "").split(",") if h]
if hosts and len(hosts) != 2:
    sys.exit("PD_HOSTS wants two NAMESPACE:ADDRESS pairs, prefill's then decode's")


def on_host(role):
    """Command prefix and listening arguments for the prefill or decode engine, and its address."""
    if not hosts:
        return [], [], "127.0.0.1"
    ns, addr = hosts[0 if role == "prefill" else 1]
    # The side channel on every interface: the engine advertises its address on its default route.
    return ["ip", "netns", "exec", ns], ["--host", addr, "--kv-host", "0.0.0.0"], addr


def start(name, args, prefix=()):
    log = open(os.path.join(out, f"pd_{name}.log"), "w")
    # The engines log each KV copy between the GPU cache and its host copy (its duration).
    p = subprocess.Popen(list(prefix) + [exe, "--log", "info,tandem_model=debug"] + args, stdout=log,
                         stderr=subprocess.STDOUT)
    procs.append(p)
    return p


# A first token for every long prompt sent, none twice in a run (below PD_VOCAB of them).
fresh_starts = itertools.count(1)


def ttft(url, prompt):
    """Seconds to the first token of `prompt` (max_tokens 1: the answer is the first token). Each
    of the three tries changes the prompt's first token, so that no engine's prefix cache holds
    any of it (the block keys chain from the first token) and every try computes and moves the
    whole prompt's KV."""
    times = []
    for _ in range(3):
        fresh = [(prompt[0] + next(fresh_starts)) % vocab] + prompt[1:]
        t0 = time.time()
        code, r = post(url, {"prompt": fresh, "max_tokens": 1, "temperature": 0, "ignore_eos": True})
        if code != 200:
            raise RuntimeError(f"long prompt answered {code}: {r}")
        times.append(time.time() - t0)
    return sorted(times)[1]


def wait_healthy(url, secs=180):
    engine_http.wait_healthy(url, f"{out}/pd_*.log", secs)


def stop_all():
    engine_http.stop_all(procs)


# Prompts of 1 to 300 tokens (several KV blocks, a partial last block), greedy, fixed length (two of them with log-probabilities).
prompts = [[(s * 31 + j * 7) % 500 + 10 for j in range(n)] for s, n in enumerate([1, 7, 16, 17, 64, 150, 300, 33])]
bodies = [{"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True} for p in prompts]
vocab = int(os.environ.get("PD_VOCAB", "1000"))  # token ids stay below this
prompts = [[t % vocab for t in p] for p in prompts]
bodies = [{"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True} for p in prompts]
# Two ask for log-probabilities: through P/D the decode engine samples the first token itself
# (from the last prompt token recomputed over the loaded KV by the one-row kernels, where
# colocated used the prefill's), so without --batch-invariant its logits, and the KV of that
# token every later one reads, differ from colocated's by bf16 rounding (measured on an H200,
# preset:qwen3-0.6b: up to 0.13 apart, the tokens equal). With --batch-invariant the kernels
# give the same bits either way, so the values must agree to float rounding.
for i in (1, 5):
    bodies[i]["logprobs"] = 3
LOGPROB_TOLERANCE = 1e-4 if invariant else 0.25
burst = [{"prompt": [((s * 13 + j * 5) % 700 + 10) % vocab for j in range(1 + (s * 37) % 600)], "max_tokens": 16,
          "temperature": 0, "ignore_eos": True} for s in range(50)]
long_prompt = [((j * 11) % 900 + 10) % vocab for j in range(int(os.environ.get("PD_LONG", "4000")))]
# (mode, transport, prefill block size, decode block size)
settings = [("push", "tcp", 16, 16), ("pull", "tcp", 16, 16)]
if device != "cpu":
    settings += [("push", "cuda-ipc", 16, 16), ("pull", "cuda-ipc", 16, 16),
                 ("push", "cuda-ipc", 16, 32), ("pull", "cuda-ipc", 32, 16), ("push", "auto", 16, 16)]
# PD_NIXL=1: also over NIXL (a tandem built with --features nixl, libnixl_capi.so on the
# library path), GPU engines registering their device caches.
if os.environ.get("PD_NIXL") == "1":
    settings += [("push", "nixl", 16, 16), ("pull", "nixl", 16, 16), ("push", "nixl", 16, 32), ("pull", "nixl", 32, 16)]
# The long prompt's TTFT per setting, for PD_PUSH_OVER_PULL.
long_ttft = {}
# PD_SETTINGS=tcp (or any text in the setting's name; several, comma-separated) keeps only the
# matching settings.
keep = os.environ.get("PD_SETTINGS", "").split(",")
settings = [s for s in settings if any(k in "_".join(map(str, s)) for k in keep)]
status = 0
try:
    start("colocated", ["serve", "--port", "18300", "--block-size", "16"] + common)
    c = "http://127.0.0.1:18300"
    wait_healthy(c)
    want, want_logprobs = [], []
    for b in bodies:
        code, r = post(c, b)
        if code != 200:
            raise RuntimeError(f"colocated answered {code}: {r}")
        want.append(r["choices"][0]["token_ids"])
        want_logprobs.append((r["choices"][0].get("logprobs") or {}).get("token_logprobs"))
    burst_want = []
    for b in burst:
        code, r = post(c, b)
        if code != 200:
            raise RuntimeError(f"colocated answered {code}: {r}")
        burst_want.append(r["choices"][0]["token_ids"])
    colocated_ttft = ttft(c, long_prompt)
    print(f"colocated on {device}: TTFT of a {len(long_prompt)}-token prompt {colocated_ttft * 1e3:.1f} ms")
    stop_all()
    for n, (mode, transport, pbs, dbs) in enumerate(settings):
        base = 18400 + 100 * n
        name = f"{mode}_{transport}_{pbs}_{dbs}"
        (p_prefix, p_listen, p_addr), (d_prefix, d_listen, d_addr) = on_host("prefill"), on_host("decode")
        p, d, r = f"http://{p_addr}:{base}", f"http://{d_addr}:{base + 1}", f"http://127.0.0.1:{base + 2}"
        kv = ["--kv-mode", mode, "--kv-transport", transport] + (["--kv-host-gib", "8"] if transport in ("tcp", "auto") else [])
        start(f"{name}_prefill", ["serve", "--role", "prefill", "--port", str(base), "--kv-port", str(base + 50),
                                  "--block-size", str(pbs)] + p_listen + kv + common + engine_args, p_prefix)
        start(f"{name}_decode", ["serve", "--role", "decode", "--port", str(base + 1), "--kv-port", str(base + 51),
                                 "--block-size", str(dbs)] + d_listen + kv + common + engine_args, d_prefix)
        wait_healthy(p)
        wait_healthy(d)
        start(f"{name}_router", ["router", "--mode", mode, "--prefill", p, "--decode", d, "--port", str(base + 2)])
        wait_healthy(r)
        same, errors, t0 = 0, [], time.time()
        for i, b in enumerate(bodies):
            code, ans = post(r, b)
            if code != 200:
                errors.append(f"request {i}: {code} {ans}")
            elif ans["choices"][0]["token_ids"] == want[i]:
                same += 1
                got = (ans["choices"][0].get("logprobs") or {}).get("token_logprobs")
                if want_logprobs[i] is not None:
                    worst = max((abs(a - b) for a, b in zip(got or [], want_logprobs[i])), default=float("inf"))
                    if not got or len(got) != len(want_logprobs[i]) or worst > LOGPROB_TOLERANCE:
                        errors.append(f"request {i}: log-probabilities {got} vs colocated {want_logprobs[i]}")
            else:
                errors.append(f"request {i} ({len(b['prompt'])} prompt tokens): {ans['choices'][0]['token_ids']} "
                              f"!= colocated {want[i]}")
        secs = time.time() - t0
        with concurrent.futures.ThreadPoolExecutor(len(burst)) as pool:
            answers = list(pool.map(lambda b: post(r, b), burst))
        burst_ok = sum(code == 200 for code, _ in answers)
        burst_same = sum(code == 200 and a["choices"][0]["token_ids"] == w for (code, a), w in zip(answers, burst_want))
        if invariant and burst_same != burst_ok:
            errors.append(f"burst: {burst_ok - burst_same} answers differ from colocated with --batch-invariant")
        if burst_ok != len(burst):
            errors.append(f"burst: {len(burst) - burst_ok} of {len(burst)} requests failed: "
                          f"{[a for code, a in answers if code != 200][:2]}")
        time.sleep(0.5)  # the last releases reach the pools
        leaks = []
        for role, url in (("prefill", p), ("decode", d)):
            free, total = metric(url, "tandem:kv_blocks_free"), metric(url, "tandem:kv_blocks_total")
            if free != total:
                leaks.append(f"{role} {free:.0f}/{total:.0f} blocks free")
        if leaks:
            errors.append("KV blocks not back to baseline: " + ", ".join(leaks))
        # auto picks cuda-ipc between two GPU engines of one host
        link = {"tcp": "tcp", "cuda-ipc": "cuda_ipc", "nixl": "nixl",
                "auto": "cuda_ipc" if device != "cpu" else "tcp"}[transport]
        links = metric(p, "tandem:kv_connector", f"links_{link}")
        if not links:
            errors.append(f"prefill opened no {link} connection (links_{link}: {links})")
        t_long = ttft(r, long_prompt)
        # Every transfer landed: a failed one is recomputed at decode (same answer, slower), so
        # only the counters tell it happened.
        failed = {role: metric(url, "tandem:kv_connector", "transfers_failed") for role, url in (("prefill", p), ("decode", d))}
        if any(failed.values()):
            errors.append(f"KV transfers failed (recomputed at decode): {failed}")
        print(f"P/D on {device} ({model}), {name}: {same}/{len(bodies)} answers equal colocated token for token, "
              f"{secs:.1f} s; burst of {len(burst)}: {burst_ok} ok, {burst_same} equal colocated (one at a time); "
              f"blocks back: {'yes' if not leaks else 'NO'}; TTFT {len(long_prompt)} tokens {t_long * 1e3:.1f} ms "
              f"({t_long / colocated_ttft:.2f}x colocated)")
        for e in errors[:5]:
            print("   ", e)
        if errors:
            status = 1
        long_ttft[name] = t_long
        stop_all()
    # The long prompt's TTFTs for figures (`tandem bench plot --link` over two_hosts.sh's
    # LINK_RATES runs): colocated and each setting, with the link's rate when one was set.
    with open(os.path.join(out, "ttft.json"), "w") as f:
        json.dump({"prompt_tokens": len(long_prompt), "link": os.environ.get("LINK_RATE"),
                   "ttft_ms": {"colocated": colocated_ttft * 1e3, **{k: v * 1e3 for k, v in long_ttft.items()}}}, f)
    # PD_PUSH_OVER_PULL=R: push may pay at most R of the time pull spends past colocated (the
    # transfer pull waits for after the prefill), for each transport and block sizes both ran
    # with: a link slower than the prefill, which push overlaps. (Push / pull TTFT itself moves
    # with the CPU's speed: a slower prefill leaves the same transfer a smaller share.)
    bound = os.environ.get("PD_PUSH_OVER_PULL")
    for name, t_push in long_ttft.items():
        t_pull = long_ttft.get(name.replace("push_", "pull_", 1))
        if bound and name.startswith("push_") and t_pull:
            pull_extra, push_extra = t_pull - colocated_ttft, t_push - colocated_ttft
            ok = pull_extra > 0 and push_extra <= float(bound) * pull_extra
            print(f"{name}: push pays {push_extra * 1e3:.0f} ms past colocated of pull's {pull_extra * 1e3:.0f} ms "
                  f"({push_extra / pull_extra if pull_extra > 0 else float('inf'):.2f}, at most {bound}; "
                  f"push / pull TTFT {t_push / t_pull:.2f}): {'ok' if ok else 'FAILED'}")
            status = status if ok else 1
except Exception as e:  # a process that never came up, an unreachable port
    print(f"P/D on {device}: FAILED: {e}")
    status = 1
finally:
    stop_all()
sys.exit(status)
