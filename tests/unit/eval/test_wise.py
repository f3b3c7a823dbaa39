"""WISE: prompt loading, score parsing, WiScore, and the judge client against a local HTTP server that
speaks the OpenAI chat-completions protocol (scripted answers incl. errors and a malformed answer)."""

from __future__ import annotations

import base64
import io
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from chunkgrpo.errors import UserError
from chunkgrpo.eval import wise as W

SECRET = "sk-test-secret-123"
GOOD = "Consistency: 2\nRealism: 1\nAesthetic Quality: 1"


# ---- local chat-completions server ------------------------------------------------------------------


class _Server:
    """Answers by the PROMPT line of the rubric; each prompt has a script of answers consumed in order
    (last one repeats). An answer is a str (content), an int (HTTP status) or "<nochoices>"."""

    def __init__(self, scripts):
        self.scripts = {k: list(v) for k, v in scripts.items()}
        self.requests = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests.append(
                        {"path": self.path, "auth": self.headers.get("Authorization"), "body": body}
                    )
                    text = body["messages"][1]["content"][0]["text"]
                    prompt = re.search(r'PROMPT: "(.*)"', text).group(1)
                    script = outer.scripts[prompt]
                    answer = script.pop(0) if len(script) > 1 else script[0]
                if isinstance(answer, int):
                    self.send_response(answer)
                    self.end_headers()
                    self.wfile.write(b"overloaded")
                    return
                payload = {
                    "id": "x",
                    "object": "chat.completion",
                    "model": body["model"],
                    "choices": []
                    if answer == "<nochoices>"
                    else [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": answer},
                            "finish_reason": "stop",
                        }
                    ],
                }
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


# ---- prompt files -----------------------------------------------------------------------------------


def _write_wise(folder, ids_by_file, rewrite=True, original=True):
    folder.mkdir(parents=True, exist_ok=True)
    for fname, ids in ids_by_file.items():
        for variant, suffix in (("rewrite", "_rewrite"), ("original", "")):
            if (variant == "rewrite" and not rewrite) or (variant == "original" and not original):
                continue
            items = [{"prompt_id": i, "Prompt": f"{variant} prompt {i}", "Explanation": f"expl {i}",
                      "Category": "x", "Subcategory": "sub"} for i in ids]
            (folder / f"{fname}{suffix}.json").write_text(json.dumps(items))
    return folder


FILES = {
    "cultural_common_sense": [1, 2],
    "spatio-temporal_reasoning": [401, 568],
    "natural_science": [701, 801],
}


def test_load_prompts_default_rewrite(tmp_path):
    d = _write_wise(tmp_path / "wise", FILES)
    ps = W.load_prompts(d)
    assert [p.prompt_id for p in ps] == [1, 2, 401, 568, 701, 801]
    assert ps[0].prompt == "rewrite prompt 1" and ps[0].explanation == "expl 1"
    assert [p.category for p in ps] == ["culture", "culture", "time", "space", "biology", "physics"]
    assert W.load_prompts(d, variant="original")[0].prompt == "original prompt 1"
    assert len(W.load_prompts(d / "natural_science_rewrite.json")) == 2


def test_load_prompts_errors(tmp_path, monkeypatch):
    monkeypatch.delenv(W.WISE_DIR_ENV, raising=False)
    with pytest.raises(UserError, match="not redistributable.*cultural_common_sense_rewrite.json"):
        W.load_prompts()
    d = _write_wise(tmp_path / "orig_only", FILES, rewrite=False)
    with pytest.raises(
        UserError, match="lacks cultural_common_sense_rewrite.json.*found the original variant"
    ):
        W.load_prompts(d)
    part = _write_wise(tmp_path / "partial", {"natural_science": [701]})
    with pytest.raises(UserError, match="spatio-temporal_reasoning_rewrite.json"):
        W.load_prompts(part)
    assert [p.prompt_id for p in W.load_prompts(part, allow_partial=True)] == [701]
    with pytest.raises(UserError, match="does not exist"):
        W.load_prompts(tmp_path / "missing")
    with pytest.raises(UserError, match="variant"):
        W.load_prompts(d, variant="verified")
    monkeypatch.setenv(W.WISE_DIR_ENV, str(_write_wise(tmp_path / "env", FILES)))
    assert len(W.load_prompts()) == 6


# ---- parsing and scores -----------------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    (GOOD, {"consistency": 2, "realism": 1, "aesthetic_quality": 1}),
    ("**Consistency**: 1\n**Realism**: 0\n**Aesthetic Quality**: 2", {"consistency": 1, "realism": 0,
                                                                     "aesthetic_quality": 2}),
    ("consistency:0 realism: 0 aesthetic quality :1",
     {"consistency": 0, "realism": 0, "aesthetic_quality": 1}),
    ("<think>Consistency: 0 maybe</think>\nConsistency: 2\nRealism: 2\nAesthetic Quality: 2",
     {"consistency": 2, "realism": 2, "aesthetic_quality": 2}),
    ("1\n2\n0", {"consistency": 1, "realism": 2, "aesthetic_quality": 0}),
    ("Consistency: 2\nRealism: 1", None),  # missing one
    ("The image is lovely.", None),
    ("", None),
    (None, None),
])
def test_parse_scores(text, expected):
    """Answers both parsers read the same way (the cases where they differ: test_wise_parity.py)."""
    assert W.parse_scores(text) == expected
    assert W.parse_scores(text, "strict") == expected


def test_wiscore():
    assert W.wiscore(2, 2, 2) == pytest.approx(1.0)
    assert W.wiscore(0, 0, 0) == 0
    assert W.wiscore(2, 1, 1) == pytest.approx((1.4 + 0.2 + 0.1) / 2)


def test_aggregate_official_weights_when_complete():
    recs = []
    for name, lo, _hi, _w in W.CATEGORIES:
        for j, c in enumerate((2, 0)):
            recs.append({"prompt_id": lo + j, "category": name, "consistency": c, "realism": 2,
                         "aesthetic_quality": 2, "wiscore": W.wiscore(c, 2, 2)})
    res = W.aggregate(recs)
    assert res["complete"] and res["overall_rule"].startswith("official")
    cat = (W.wiscore(2, 2, 2) + W.wiscore(0, 2, 2)) / 2
    assert res["categories"]["time"]["wiscore"] == pytest.approx(cat)
    assert res["overall"] == pytest.approx(cat * sum(w for *_, w in W.CATEGORIES))
    assert res["categories"]["culture"]["mean_consistency"] == 1.0


# ---- judge over HTTP --------------------------------------------------------------------------------


@pytest.fixture()
def wise_run(tmp_path, monkeypatch):
    ids = {
        "cultural_common_sense": [1, 2],
        "spatio-temporal_reasoning": [401, 402],
        "natural_science": [701, 702],
    }
    d = _write_wise(tmp_path / "wise", ids)
    images = tmp_path / "images"
    images.mkdir()
    for i in [1, 2, 401, 402, 701]:  # 702 has no image
        Image.new("RGB", (16, 16), (i % 255, 0, 0)).save(W.image_path(images, i))
    monkeypatch.setenv("WISE_TEST_KEY", SECRET)
    return d, images


def test_judge_end_to_end(wise_run):
    d, images = wise_run
    scripts = {
        "rewrite prompt 1": [GOOD],
        "rewrite prompt 2": ["**Consistency**: 1\n**Realism**: 2\n**Aesthetic Quality**: 0"],
        "rewrite prompt 401": [
            503,
            "<nochoices>",
            "Consistency: 0\nRealism: 0\nAesthetic Quality: 0",
        ],  # retried
        "rewrite prompt 402": ["Sure! The image shows a clock.", GOOD],  # unparsable once, then fine
        "rewrite prompt 701": ["Rating: excellent overall."],  # always malformed -> failed
        "rewrite prompt 702": [GOOD],
    }
    sleeps = []
    with _Server(scripts) as srv:
        cfg = W.JudgeConfig(
            base_url=srv.url,
            model="judge-vlm",
            api_key_env="WISE_TEST_KEY",
            max_attempts=3,
            backoff_s=0.5,
            workers=2,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        client = W.JudgeClient(cfg, sleep=sleeps.append)
        res = W.evaluate(W.load_prompts(d), images, client)
        reqs = list(srv.requests)

    assert res["judge"]["model"] == "judge-vlm" and res["variant"] == "rewrite"
    assert res["missing"] == [702]
    assert res["n_scored"] == 4 and res["n_failed"] == 1
    assert res["failed"] == [
        {"prompt_id": 701, "error": "unparsable answer", "answer": "Rating: excellent overall."}
    ]
    by_id = {r["prompt_id"]: r for r in res["records"]}
    assert by_id[1]["wiscore"] == pytest.approx(W.wiscore(2, 1, 1))
    assert by_id[401]["attempts"] == 3 and by_id[401]["wiscore"] == 0
    assert by_id[402]["attempts"] == 2
    assert by_id[701]["attempts"] == 3 and "wiscore" not in by_id[701]
    cats = res["categories"]
    assert cats["culture"]["wiscore"] == pytest.approx((W.wiscore(2, 1, 1) + W.wiscore(1, 2, 0)) / 2)
    assert cats["time"]["wiscore"] == pytest.approx((0.0 + W.wiscore(2, 1, 1)) / 2) and "space" not in cats
    assert cats["biology"] == {"wiscore": None, "n": 0, "n_failed": 1, "mean_consistency": None,
                               "mean_realism": None, "mean_aesthetic_quality": None}
    assert not res["complete"]
    scored = [W.wiscore(2, 1, 1), W.wiscore(1, 2, 0), 0.0, W.wiscore(2, 1, 1)]
    assert res["overall"] == pytest.approx(sum(scored) / 4)
    # zero policy keeps the failure in the mean
    assert W.aggregate(res["records"], failed_policy="zero")["overall"] == pytest.approx(sum(scored) / 5)

    # protocol: path, auth, model, temperature, extra body, system + rubric + base64 PNG data URL
    assert len(reqs) == 1 + 1 + 3 + 2 + 3
    r0 = reqs[0]
    assert r0["path"] == "/v1/chat/completions" and r0["auth"] == f"Bearer {SECRET}"
    body = r0["body"]
    assert body["model"] == "judge-vlm" and body["temperature"] == 0.0 and body["max_tokens"] == 2000
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert (
        body["messages"][0]["role"] == "system" and "Vincennes" in body["messages"][0]["content"][0]["text"]
    )
    user = body["messages"][1]["content"]
    assert "Aesthetic Quality (0-2)" in user[0]["text"] and 'EXPLANATION: "expl' in user[0]["text"]
    url = user[1]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    assert Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).size == (16, 16)
    # retries back off exponentially (0.5 * 2^(k-1), jittered into [50%, 100%])
    assert len(sleeps) == 2 + 1 + 2 and all(0.25 <= s <= 1.0 for s in sleeps)
    # the key is never part of the result or the client's repr
    assert SECRET not in json.dumps(res) and SECRET not in repr(client)


def test_judge_permanent_http_error_is_user_error(wise_run):
    d, images = wise_run
    with _Server({f"rewrite prompt {i}": [401] for i in (1, 2, 401, 402, 701, 702)}) as srv:
        client = W.JudgeClient(
            W.JudgeConfig(base_url=srv.url, api_key_env="NOPE_UNSET"), sleep=lambda s: None
        )
        with pytest.raises(UserError, match="HTTP 401"):
            client.judge(W.image_path(images, 1), "rewrite prompt 1", "e")
        assert srv.requests[0]["auth"] is None  # unset key -> no Authorization header
    with _Server({"p": [400]}) as srv:  # a per-item 4xx fails that item at once, without retries
        res = W.JudgeClient(W.JudgeConfig(base_url=srv.url), sleep=lambda s: None).judge(
            W.image_path(images, 1), "p", "e")
        assert res.scores is None and res.attempts == 1 and res.error.startswith("HTTP 400")
        assert len(srv.requests) == 1


def test_judge_unreachable_counts_as_failed(wise_run):
    d, images = wise_run
    cfg = W.JudgeConfig(base_url="http://127.0.0.1:9/v1", max_attempts=2, timeout_s=2, backoff_s=0)
    res = W.JudgeClient(cfg, sleep=lambda s: None).judge(W.image_path(images, 1), "p", "e")
    assert res.scores is None and res.attempts == 2 and "ConnectionError" in res.error


def test_judge_config_validation():
    with pytest.raises(UserError, match="base_url"):
        W.JudgeConfig(base_url="localhost:8000")
    with pytest.raises(UserError, match="max_attempts"):
        W.JudgeConfig.from_dict({"max_attempts": 0})
    with pytest.raises(UserError, match="failed_policy"):
        W.JudgeConfig(failed_policy="drop")
