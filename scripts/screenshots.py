"""Screenshots of what a user takes out of a local run: the MLflow page of the pipeline's run, the page of the
model version it registered, and the KFP-renderable artifacts of the profile and plan steps (the HTML
plots and the plan's Markdown report), as small PNGs for the docs.

    .venv/bin/python scripts/screenshots.py --home DIR [--run] [--out docs/images]

--run runs the demo first (`chunkgrpo pipeline run --local --keep-services --home DIR`, the toy world);
without it the latest run in DIR is used. The local MLflow server of DIR is started when it is not
running (`chunkgrpo.services.LocalServices`) and left as it was found. Pages are taken with Debian's
headless chromium (`apt-get install -y chromium`) over its DevTools protocol: each page gets a few
seconds to fetch its data, scrolling panes are unfolded (MLflow's tag table shows four rows and scrolls
the rest) and the whole page is captured; each PNG is reduced to a 256-colour palette. Prints one JSON
line per image (path, size in bytes, what it shows).
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
MAX_BYTES = 300_000


def chromium() -> str:
    for name in CHROMIUM:
        path = shutil.which(name)
        if path:
            return path
    raise SystemExit("screenshots: no chromium on PATH (Debian: apt-get install -y chromium)")


# Run in the page before the capture: the assistant side panel is hidden and scrolling panes (MLflow's tag
# table keeps its rows in one) drop their height limit; the viewport then grows to the tallest content.
UNFOLD = """
for (const el of document.querySelectorAll('span, div, h1, h2, h3')) {
  if (el.childElementCount === 0 && el.textContent.trim() === 'MLflow Assistant') {
    let panel = el;
    while (panel.parentElement && panel.getBoundingClientRect().height < 0.8 * innerHeight) {
      panel = panel.parentElement;
    }
    if (panel.getBoundingClientRect().width < 0.45 * innerWidth) panel.style.display = 'none';
  }
}
for (const el of document.querySelectorAll('*')) {
  const st = getComputedStyle(el);
  if ((st.overflowY === 'auto' || st.overflowY === 'scroll') && el.scrollHeight > el.clientHeight + 4
      && el !== document.scrollingElement && el.tagName !== 'BODY' && el.tagName !== 'HTML') {
    el.style.maxHeight = 'none'; el.style.overflowY = 'visible';
  }
}
"""
TALLEST = "Math.max(...Array.from(document.querySelectorAll('*'), e => e.scrollHeight))"


def _cdp(ws, method: str, **params) -> dict:
    """One DevTools call on websocket `ws`: its result (events before it are skipped)."""
    ident = _cdp.counter = getattr(_cdp, "counter", 0) + 1
    ws.send(json.dumps({"id": ident, "method": method, "params": params}))
    while True:
        msg = json.loads(ws.recv())
        if msg.get("id") == ident:
            if "error" in msg:
                raise RuntimeError(f"{method}: {msg['error']}")
            return msg.get("result", {})


def shoot(url: str, out: Path, width: int = 1280, height: int = 900, wait_s: float = 8.0,
          max_height: int = 2000) -> Path:
    """A PNG of `url` in headless chromium (DevTools protocol): loaded, given `wait_s` for the app to
    fetch its data, scrolling panes unfolded (UNFOLD), the full page captured, palette-reduced."""
    import time
    import urllib.request

    import websocket  # websocket-client, a dependency of the kubernetes client
    from PIL import Image

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
               "--remote-debugging-port=0", f"--window-size={width},{height}", "about:blank"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + 60
            while not port_file.exists() or not port_file.read_text().strip():
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("screenshots: chromium did not start its DevTools endpoint")
                time.sleep(0.2)
            port = port_file.read_text().split()[0]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as r:
                page = next(t for t in json.load(r) if t["type"] == "page")
            ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=120, suppress_origin=True)
            _cdp(ws, "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                 mobile=False)
            _cdp(ws, "Page.navigate", url=url)
            time.sleep(wait_s)
            _cdp(ws, "Runtime.evaluate", expression=UNFOLD)
            time.sleep(1.0)
            full = _cdp(ws, "Runtime.evaluate", expression=TALLEST, returnByValue=True)["result"].get("value")
            full = min(int(max(height, (full or height) + 40)), max_height)  # an app shell is 100vh tall
            _cdp(ws, "Emulation.setDeviceMetricsOverride", width=width, height=full, deviceScaleFactor=1,
                 mobile=False)
            time.sleep(1.0)
            data = _cdp(ws, "Page.captureScreenshot", format="png")["data"]
            ws.close()
        finally:
            proc.terminate()
            proc.wait(30)
        raw = Path(profile) / "shot.png"
        raw.write_bytes(base64.b64decode(data))
        img = Image.open(raw).convert("RGB")
        img.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)
    return out


def markdown_page(text: str, title: str) -> str:
    """The Markdown as the KFP UI shows a Markdown artifact: rendered, tables included."""
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark").enable("table").render(text)
    style = ("<style>body{font-family:sans-serif;margin:24px;color:#202124}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:4px 8px}</style>")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>{style}"
            f"</head><body>{body}</body></html>\n")


def latest_run_dir(home: Path) -> Path:
    """The newest kfp.local run folder of `home` that holds a profile and a plan output."""
    runs = sorted((p.parent.parent for p in home.rglob("plan/report")), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise SystemExit(f"screenshots: no local pipeline run under {home} (run with --run)")
    return runs[-1]


def mlflow_targets(tracking_uri: str) -> tuple[str, str]:
    """(run page URL, model version page URL) of the newest pipeline run in the local MLflow."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string="tags.`kfp.pipeline` = 'chunkgrpo-train-and-evaluate'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        raise SystemExit("screenshots: the local MLflow has no train_and_evaluate run (run with --run)")
    run = runs[0]
    name = run.data.tags.get("chunkgrpo.registered_model", "")
    version = run.data.tags.get("chunkgrpo.registered_version", "")
    base = tracking_uri.rstrip("/")
    return (f"{base}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}",
            f"{base}/#/models/{name}/versions/{version}" if name and version else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--home", required=True, help="the local runs' state dir (chunkgrpo pipeline run --home)")
    ap.add_argument("--out", default=str(REPO / "docs" / "images"))
    ap.add_argument("--run", action="store_true", help="run the toy demo first")
    ap.add_argument("--s3-port", type=int, default=8333)
    ap.add_argument("--mlflow-port", type=int, default=5000)
    args = ap.parse_args(argv)
    home, out = Path(args.home).resolve(), Path(args.out)
    ports = ["--s3-port", str(args.s3_port), "--mlflow-port", str(args.mlflow_port)]
    if args.run:
        subprocess.run([sys.executable, "-m", "chunkgrpo.cli", "pipeline", "run", "--local",
                        "--keep-services",
                        "--home", str(home), *ports], check=True)
    from chunkgrpo.services import LocalServices, LocalServicesConfig

    svc = LocalServices(LocalServicesConfig(home=str(home / "local"), s3_port=args.s3_port,
                                            mlflow_port=args.mlflow_port))
    was_running = all(s.state == "running" for s in svc.status().values())
    svc.up()
    shots = []
    try:
        env = svc.env()
        os.environ.update(env)
        run_url, version_url = mlflow_targets(env["MLFLOW_TRACKING_URI"])
        shots.append((shoot(run_url, out / "mlflow-run.png", height=1300), "MLflow: the pipeline's run"))
        if version_url:
            shots.append((shoot(version_url, out / "mlflow-model-version.png"), "MLflow: the model version"))
        run_dir = latest_run_dir(home)
        with tempfile.TemporaryDirectory(prefix="kfp-artifacts-") as tmp:
            for task, output, name in (("profile", "plot", "kfp-profile-plot.png"),
                                       ("plan", "plot", "kfp-plan-plot.png")):
                src = run_dir / task / output
                page = Path(tmp) / f"{task}.html"
                page.write_bytes(src.read_bytes())
                shots.append((shoot(page.as_uri(), out / name, height=1000, wait_s=1.0),
                              f"KFP HTML artifact: {task} {output}"))
            md = Path(tmp) / "plan-report.html"
            md.write_text(markdown_page((run_dir / "plan" / "report").read_text(), "plan report"))
            shots.append((shoot(md.as_uri(), out / "kfp-plan-report.png", height=700, wait_s=1.0),
                          "KFP Markdown artifact: plan report"))
    finally:
        if not was_running:
            svc.down()
    for path, what in shots:
        size = path.stat().st_size
        print(json.dumps({"path": os.path.relpath(path, REPO), "bytes": size, "what": what,
                          "under_limit": size < MAX_BYTES}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
