#!/usr/bin/env python3
"""The official OpenAI Python SDK against `tandem up --api-key`: completions, a streamed chat
and the model list through the router with the key; a wrong key and none raise the SDK's
AuthenticationError (a 401 in OpenAI's error shape). Then the same over HTTPS (`tandem up
--tls-cert`, a CA and certificate made with openssl), the SDK trusting that CA. Exits non-zero
on any difference.

Usage: openai_sdk_check.py TANDEM_BINARY   (needs `pip install openai` and the openssl command)
"""
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

import openai


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


KEY = "sk-sdk-check"
exe = sys.argv[1]
env = {k: v for k, v in os.environ.items() if k != "TANDEM_API_KEY"}
log = sys.stderr if os.environ.get("SDK_CHECK_LOG") else subprocess.DEVNULL


def make_tls(d):
    """A CA and a certificate it signed for 127.0.0.1 in `d`; the `--tls-*` flags naming them."""
    run = lambda *a: subprocess.run(a, check=True, cwd=d, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=tandem test CA")
    run("openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", "key.pem", "-out", "cert.csr", "-subj", "/CN=127.0.0.1")
    with open(os.path.join(d, "ext.cnf"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
    run("openssl", "x509", "-req", "-in", "cert.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "cert.pem", "-days", "1", "-extfile", "ext.cnf")
    return ["--tls-cert", os.path.join(d, "cert.pem"), "--tls-key", os.path.join(d, "key.pem"),
            "--tls-ca", os.path.join(d, "ca.pem")]


def start(extra):
    """`tandem up` on free ports (decode's KV side channel takes the port after prefill's, which
    another process may hold: up then exits at start-up, and is started again)."""
    for _ in range(5):
        port, pp, dp, kp = free_port(), free_port(), free_port(), free_port()
        up = subprocess.Popen(
            [exe, "up", "--child-log", "warn", "--port", str(port), "--prefill-port", str(pp), "--decode-port",
             str(dp), "--kv-port", str(kp), "--api-key", KEY, *extra], env=env, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.time() + 60
        while up.poll() is None and time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return up, port
            except OSError:
                time.sleep(0.2)
        if up.poll() is None:
            up.kill()
            raise RuntimeError("tandem up did not listen within 60 s")
    raise RuntimeError("tandem up exited at start-up five times")


def check(tls_dir):
    """One `tandem up` and the SDK's calls against it; 0 if all went as they should."""
    extra = make_tls(tls_dir) if tls_dir else []
    scheme = "https" if tls_dir else "http"
    client_args = {"http_client": httpx.Client(verify=os.path.join(tls_dir, "ca.pem"))} if tls_dir else {}
    up, port = start(extra)
    status = 0
    try:
        base = f"{scheme}://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=30, **client_args)
        deadline = time.time() + 60
        while True:
            try:
                models = [m.id for m in client.models.list()]
                break
            except openai.APIConnectionError:
                if time.time() > deadline or up.poll() is not None:
                    raise
                time.sleep(0.2)
        assert "tandem" in models, models
        done = client.completions.create(model="tandem", prompt="Once upon a time", max_tokens=5,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 5, done
        stream = client.chat.completions.create(model="tandem", messages=[{"role": "user", "content": "Hello"}],
                                                max_tokens=6, stream=True, extra_body={"ignore_eos": True})
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert len(pieces) >= 1, pieces
        for bad in ["sk-wrong", ""]:
            try:
                openai.OpenAI(base_url=base, api_key=bad or "none", max_retries=0, **client_args).completions.create(
                    model="tandem", prompt="x", max_tokens=1)
                print(f"a request with key {bad!r} was answered")
                status = 1
            except openai.AuthenticationError as e:
                assert e.status_code == 401 and e.body and e.body.get("type") == "AuthenticationError", e
        if tls_dir:
            # A client that does not trust the CA refuses the certificate.
            try:
                openai.OpenAI(base_url=base, api_key=KEY, max_retries=0).models.list()
                print("a client without the CA accepted the router's certificate")
                status = 1
            except openai.APIConnectionError:
                pass
        print(f"OpenAI SDK {openai.__version__} against tandem up --api-key{' --tls-cert' if tls_dir else ''}: "
              f"models {models}, completion {done.choices[0].text!r}, streamed chat in {len(pieces)} chunks, "
              f"wrong keys refused: {'ok' if status == 0 else 'FAILED'}")
    except Exception as e:  # the server never came up, or an answer the SDK could not read
        import traceback
        traceback.print_exc()
        print(f"OpenAI SDK check ({scheme}) FAILED: {e!r} (cause: {e.__cause__!r}; tandem up "
              f"{'exited ' + str(up.poll()) if up.poll() is not None else 'running'})")
        status = 1
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(20)
        except subprocess.TimeoutExpired:
            up.kill()
            status = 1
    return status


status = check(None)
with tempfile.TemporaryDirectory() as d:
    status |= check(d)
sys.exit(status)
