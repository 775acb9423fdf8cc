"""What the P/D check scripts (pd_check.py, ../partition_check.py) say to tandem's servers over
HTTP, and how they stop the processes they started."""
import json
import subprocess
import time
import urllib.error
import urllib.request


def post(url, body, timeout=120):
    """POSTs a completion: (status, JSON answer), or (status, text) for an HTTP error."""
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def metric(url, name, label=None):
    """A value of `/metrics`, the first line of `name` (with `label`, if given)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name) and (label is None or f'"{label}"' in line):
                return float(line.split()[-1])
    return None


def wait_healthy(url, logs, secs=180):
    """Waits until `url` answers /health, or raises naming `logs` to look at."""
    deadline = time.time() + secs
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} never became healthy (see {logs})")


def stop_all(procs):
    """Terminates `procs` (killing any that outlast 20 s) and empties the list."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
    procs.clear()
