"""Screenshots of what a user takes out of a local run: the MLflow page of the pipeline's run, the page of the
model version it registered, and the KFP-renderable artifacts of the profile and plan steps (the HTML
plots and the plan's Markdown report), as small PNGs for the docs.

    .venv/bin/python scripts/screenshots.py --home DIR [--run] [--out docs/images]

--run runs the demo first (`chunkgrpo pipeline run --local --keep-services --home DIR`, the toy world);
without it the latest run in DIR is used. The local MLflow server of DIR is started when it is not
running (`chunkgrpo.services.LocalServices`) and left as it was found. Pages are taken with Debian's
headless chromium (`apt-get install -y chromium`), which runs MLflow's single-page app for a few
seconds of virtual time before the capture; each PNG is reduced to a 256-colour palette. Prints one JSON
line per image (path, size in bytes, what it shows).
"""

from __future__ import annotations

import argparse
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


def shoot(url: str, out: Path, width: int = 1280, height: int = 900, wait_ms: int = 15000) -> Path:
    """A PNG of `url` as headless chromium renders it after `wait_ms` of virtual time, palette-reduced."""
    from PIL import Image

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        raw = Path(profile) / "shot.png"
        cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
               f"--window-size={width},{height}", f"--virtual-time-budget={wait_ms}",
               f"--screenshot={raw}", url]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        if not raw.exists():
            raise SystemExit(f"screenshots: chromium made no image of {url}: {r.stderr.strip()[-500:]}")
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
                              filter_string="tags.`kfp.pipeline` = 'train_and_evaluate'",
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
        shots.append((shoot(run_url, out / "mlflow-run.png", height=1100), "MLflow: the pipeline's run"))
        if version_url:
            shots.append((shoot(version_url, out / "mlflow-model-version.png"), "MLflow: the model version"))
        run_dir = latest_run_dir(home)
        with tempfile.TemporaryDirectory(prefix="kfp-artifacts-") as tmp:
            for task, output, name in (("profile", "plot", "kfp-profile-plot.png"),
                                       ("plan", "plot", "kfp-plan-plot.png")):
                src = run_dir / task / output
                page = Path(tmp) / f"{task}.html"
                page.write_bytes(src.read_bytes())
                shots.append((shoot(page.as_uri(), out / name, height=1000, wait_ms=2000),
                              f"KFP HTML artifact: {task} {output}"))
            md = Path(tmp) / "plan-report.html"
            md.write_text(markdown_page((run_dir / "plan" / "report").read_text(), "plan report"))
            shots.append((shoot(md.as_uri(), out / "kfp-plan-report.png", height=700, wait_ms=2000),
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
