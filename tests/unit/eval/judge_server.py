"""A local OpenAI-compatible chat-completions server for judge tests (threaded `http.server` on a free
127.0.0.1 port, started and stopped by the test).

Answers are scripted per PROMPT (the line `PROMPT: "..."` of the WISE rubric): each prompt has a list of
answers consumed in order (the last one repeats). An answer is
- a str: the message content,
- an int: an HTTP status with a plain-text body (e.g. 503, 429, 401),
- "<nochoices>": a 200 response whose `choices` list is empty (malformed),
- "<notjson>": a 200 response that is not JSON,
- {"refusal": "..."}: an OpenAI refusal (content null, `message.refusal` set).
Prompts without a script get `default` (a str or a callable prompt -> answer).
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

_PROMPT_RE = re.compile(r'PROMPT: "(.*)"')


class JudgeServer:
    def __init__(self, scripts: dict[str, list[Any]] | None = None,
                 default: str | Callable[[str], Any] | None = None) -> None:
        self.scripts = {k: list(v) for k, v in (scripts or {}).items()}
        self.default = default
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _send(self, status: int, data: bytes, ctype: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                text = body["messages"][1]["content"][0]["text"]
                m = _PROMPT_RE.search(text)
                prompt = m.group(1) if m else ""
                with outer.lock:
                    outer.requests.append({"path": self.path, "auth": self.headers.get("Authorization"),
                                           "body": body, "prompt": prompt})
                    answer = outer._next(prompt)
                if isinstance(answer, int):
                    return self._send(answer, b"scripted error", "text/plain")
                if answer == "<notjson>":
                    return self._send(200, b"<html>gateway</html>", "text/html")
                if isinstance(answer, dict):
                    message = {"role": "assistant", "content": None, "refusal": answer["refusal"]}
                else:
                    message = {"role": "assistant", "content": answer, "refusal": None}
                choices = (
                    []
                    if answer == "<nochoices>"
                    else [{"index": 0, "message": message, "finish_reason": "stop"}]
                )
                payload = {"id": "chatcmpl-test", "object": "chat.completion", "model": body["model"],
                           "choices": choices}
                self._send(200, json.dumps(payload).encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def _next(self, prompt: str) -> Any:
        script = self.scripts.get(prompt)
        if script:
            return script.pop(0) if len(script) > 1 else script[0]
        if callable(self.default):
            return self.default(prompt)
        if self.default is None:
            return 404
        return self.default

    def count(self, prompt: str) -> int:
        return sum(1 for r in self.requests if r["prompt"] == prompt)

    def __enter__(self) -> "JudgeServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)
