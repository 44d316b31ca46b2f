"""Two engines on two hosts share one cache through Redis; then move, manifests and warm.

    .venv/bin/python demo/sharing_demo.py [--clauses 60] [--work .cache]

Starts its own ``redis-server`` (Debian's package) on a free loopback port and two vLLM
engines, one after the other, each on its own store (``host1``, ``host2`` in the work
folder), both with ``remote_url`` set to that server. Host 1 answers a question about a long
document with a LoRA adapter; host 2, which has never seen the document, answers another
question about it: vLLM reports the document's tokens as cached, loaded from Redis, and the
answer is the one host 2 gives with no cache at all. Then an operator session on host 2's
store through the daemon (``lmctl serve --remote URL``): lookup per tier, ``move --to
remote``, a pin refused for chunks only Redis holds, ``warm`` back, ``pin --export-manifest``,
a drain to Redis and ``warm --manifest --pin`` from it, and the daemon's Prometheus metrics
(``serve --metrics``: the engines' lookups, loads and saves, counted in their processes).
Everything it starts is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
import demo.engine  # noqa: E402,F401  (sets vLLM's environment before it is imported)
from demo.engine import Engine  # noqa: E402
from demo.models import make_lora, smollm2  # noqa: E402
from demo.vllm_demo import SERVED_NAME, chat_messages, chat_prompt, document, ttft  # noqa: E402
from testsupport.ports import free_port  # noqa: E402
from testsupport.redis import Server, secret_file  # noqa: E402

LMCTL = str(Path(sys.executable).with_name("lmctl"))


def engine(model: Path, store: Path, url: str, secret: Path) -> Engine:
    return Engine(model, store, max_model_len=4096, served_model_name=SERVED_NAME,
                  connector={"remote_url": url, "remote_key_prefix": "demo", "remote_secret_file": str(secret),
                             "load_policy": "always"})


def shell(work: Path, *args: str) -> None:
    """Run ``lmctl ARGS`` in ``work`` and print it like a terminal would."""
    print(f"$ lmctl {shlex.join(args)}", flush=True)
    res = subprocess.run([LMCTL, *args], cwd=work, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, LMCTL_STORE="host2", COLUMNS="110"))
    sys.stdout.write(res.stdout + res.stderr)
    if res.returncode:
        print(f"(exit {res.returncode})")
    print(flush=True)


def scrape(port: int) -> None:
    """Print what Prometheus would scrape from the daemon (lmctl's own series, not the
    client library's process metrics)."""
    print(f"$ curl -s 127.0.0.1:{port}/metrics | grep '^lmctl_' | grep -v ' 0.0$'")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("lmctl_") and not line.endswith(" 0.0") and "_bucket{" not in line:
                print(line)
    print(flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clauses", type=int, default=60, help="document length in clauses (about 18 tokens each)")
    ap.add_argument("--work", default=str(ROOT / ".cache"), help="folder for the model, adapter and stores")
    args = ap.parse_args()
    work = Path(args.work).resolve()
    model = smollm2(work / "models" / "smollm2-135m-instruct")
    adapter_path = make_lora(model, work / "adapters" / "civil", seed=11)
    share = work / "sharing"
    shutil.rmtree(share, ignore_errors=True)
    share.mkdir(parents=True)

    from transformers import AutoTokenizer
    from vllm.lora.request import LoRARequest

    tok = AutoTokenizer.from_pretrained(model)
    doc = document(args.clauses)
    civil = LoRARequest("civil", 1, str(adapter_path))
    q1, q2 = "What must the Tenant pay each month?", "How can the agreement be ended?"
    (share / "lease.json").write_text(json.dumps(chat_messages(doc, q1), indent=1))

    with tempfile.TemporaryDirectory(prefix="lmctl-redis-") as tmp:
        redis = Server(Path(tmp))
        redis.wait(redis.client)
        url = redis.url
        secret = secret_file(Path(tmp))  # the deployment's secret, as `lmctl remote secret PATH` makes one
        print(f"redis-server on {url} (empty); document: "
              f"{len(tok(chat_prompt(tok, doc, ''))['input_ids'])} tokens\n")
        try:
            reference = Engine(model, None, max_model_len=4096, served_model_name=SERVED_NAME)
            expected = ttft(reference, chat_prompt(tok, doc, q2), civil, max_tokens=16)[2]
            reference.close()

            host1 = engine(model, share / "host1", url, secret)
            dt, cached, _ = ttft(host1, chat_prompt(tok, doc, q1), civil)
            print(f"host 1, adapter civil, question 1: {dt:.2f} s to the first token, {cached} cached tokens")
            host1.close()

            host2 = engine(model, share / "host2", url, secret)
            ttft(host2, chat_prompt(tok, "A short warm-up.", "Hi"), None)
            dt, cached, text = ttft(host2, chat_prompt(tok, doc, q2), civil, max_tokens=16)
            print(f"host 2, adapter civil, question 2: {dt:.2f} s to the first token, {cached} cached tokens "
                  f"(host 1's, through Redis)")
            print(f"  answer {text.strip()!r} is the cache-less answer: {text == expected}")
            dt, cached, _ = ttft(host2, chat_prompt(tok, doc, q2), None)
            print(f"host 2, base model, question 2: {cached} cached tokens (the adapter's KV is not the base "
                  "model's)\n")
            host2.close()

            port = free_port()
            daemon = subprocess.Popen([LMCTL, "serve", "--store", "host2", "--remote", url, "--metrics", str(port)],
                                      cwd=share, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                deadline = time.monotonic() + 30
                while not (share / "host2" / "lmctl.sock").exists():
                    if time.monotonic() > deadline or daemon.poll() is not None:
                        raise RuntimeError("lmctl serve did not start")
                    time.sleep(0.1)
                sel = ["--model", SERVED_NAME, "--adapter", "civil", "--messages", "lease.json"]
                shell(share, "lookup", *sel)
                shell(share, "move", "--to", "remote", "--model", SERVED_NAME, "--adapter", "civil")
                shell(share, "lookup", *sel)
                shell(share, "pin", "--label", "lease", *sel)
                shell(share, "warm", "--to", "nvme", *sel)
                shell(share, "pin", "--label", "lease", *sel)
                shell(share, "pin", "--label", "lease", "--export-manifest", "lease-manifest.json")
                shell(share, "unpin", "--label", "lease")
                shell(share, "move", "--to", "remote", "--model", SERVED_NAME, "--adapter", "civil")
                shell(share, "warm", "--manifest", "lease-manifest.json", "--to", "nvme", "--pin")
                shell(share, "lookup", *sel)
                shell(share, "status")
                scrape(port)
            finally:
                daemon.terminate()
                daemon.wait(30)
        finally:
            redis.stop()


if __name__ == "__main__":
    main()
