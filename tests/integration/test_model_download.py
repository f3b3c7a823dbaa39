"""One model download per node: real torchrun (2 gloo ranks, one node) training from an `s3://` model in the
real local SeaweedFS, with every S3 request counted by a pass-through proxy in front of it.

If every rank resolved the model itself, 2 ranks would fetch every file twice (and race on the same
cache entry); local rank 0 downloads behind a collective and the other rank reads the same files: each
model file is fetched from S3 exactly once.
"""

import collections
import http.client
import http.server
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

pytestmark = pytest.mark.integration

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization"}


class CountingProxy:
    """HTTP pass-through to the S3 server that counts requests by (method, path). The Host header is
    forwarded unchanged, so the clients' SigV4 signatures (made for the proxy's address) still verify."""

    def __init__(self, upstream: str):
        u = urlsplit(upstream)
        self.upstream = (u.hostname, u.port)
        self.requests: collections.Counter = collections.Counter()
        lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def _forward(self):
                with lock:
                    proxy.requests[(self.command, self.path.split("?", 1)[0])] += 1
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=120)
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    if k.lower() not in HOP:
                        conn.putheader(k, v)
                conn.endheaders(body)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP | {"content-length"}:
                        self.send_header(k, v)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def gets(self, prefix: str) -> collections.Counter:
        hits = {p: n for (m, p), n in self.requests.items() if m == "GET" and prefix in p}
        return collections.Counter(hits)


def test_two_ranks_download_the_s3_model_once(services, tiny_model_dir, tmp_path):
    from chunkgrpo.processes import free_ports
    from chunkgrpo.store.client import ArtifactStore
    from chunkgrpo.store.manifest import MANIFEST_NAME

    bucket = services.store_config.bucket
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    manifest = ArtifactStore(services.store_config).put_folder(tiny_model_dir, f"s3://{bucket}/models/{name}")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na red car\nthree apples\na dog\n")
    cache = tmp_path / "cache"
    with CountingProxy(services.env["CHUNKGRPO_S3_ENDPOINT"]) as proxy:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env.update({k: v for k, v in services.env.items() if not k.startswith("MLFLOW_")})
        env.update({"CHUNKGRPO_S3_ENDPOINT": proxy.url, "CHUNKGRPO_CACHE": str(cache), "OMP_NUM_THREADS": "1",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
        (port,) = free_ports(1)
        cmd = [TORCHRUN, "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}", "-m",
               "chunkgrpo.train", "--config", "tiny_cpu", f"model=s3://{bucket}/models/{name}",
               f"prompts={prompts}",
               f"output_dir={tmp_path / 'out'}", "progress=false", "max_steps=1"]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        gets = proxy.gets(f"/{bucket}/models/{name}/")
    files = {p for p in gets if not p.endswith("/" + MANIFEST_NAME)}
    assert len(files) == len(manifest.files), sorted(gets)  # every file came through the proxy
    twice = {p: n for p, n in gets.items() if p in files and n > 1}
    assert not twice, f"model files fetched more than once by 2 ranks on one node: {twice}"
    entries = [d for d in (cache / "models").iterdir() if d.is_dir()]
    assert len(entries) == 1 and (entries[0] / "model_index.json").exists()
