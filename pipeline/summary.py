"""What `chunkgrpo pipeline run --local` prints after a successful run: where every artifact is (local
paths, s3:// URIs), the MLflow run, the registry outcome, where the wall time went and the services'
state."""

from pipeline.task_log import rel as _rel


def stage_lines(stages: dict) -> list[str]:
    """The per-stage time breakdown of a local run (seconds, with the share of the total)."""
    total = stages.get("total") or sum(v for k, v in stages.items() if k in ("services", "model", "pipeline"))
    if not total:
        return []
    out = ["  time breakdown   (where the wall time went)"]
    for name, s in stages.items():
        if name == "total":
            continue
        indent = "      " if name.startswith("task ") else "    "
        out.append(f"{indent}{name:<24} {s:7.1f} s  {100 * s / total:5.1f} %")
    out.append(f"    {'total':<24} {total:7.1f} s")
    return out


def mlflow_url(tracking_uri: str, run_id: str) -> str:
    if not (tracking_uri and run_id):
        return ""
    try:
        from mlflow import MlflowClient

        exp = MlflowClient(tracking_uri).get_run(run_id).info.experiment_id
        return f"{tracking_uri}/#/experiments/{exp}/runs/{run_id}"
    except Exception:
        return tracking_uri


def summary_lines(r) -> list[str]:
    """The summary of `r` (a `pipeline.local_run.LocalRun`), one line per item."""
    t, env = r.tasks, r.env
    mlflow = env.get("MLFLOW_TRACKING_URI", "")
    art = lambda task, name: t.get(task, {}).get("artifacts", {}).get(name, {})  # noqa: E731
    par = lambda task, name, default="": t.get(task, {}).get("parameters", {}).get(name, default)  # noqa: E731
    lines = [f"{r.pipeline}: SUCCEEDED in {r.wall_s:.1f} s (kfp.local, SubprocessRunner)",
             f"  kfp run dir      {_rel(str(r.run_dir))}"]
    if r.log_path is not None:
        lines.append(f"  full log         {_rel(str(r.log_path))}")
    run_id = r.mlflow_run_id
    if run_id:
        lines.append(f"  MLflow run       {run_id}  {r.mlflow_url}")
    cached = lambda task: "; cached: an earlier run's output" if t[task].get("cached") else ""  # noqa: E731
    if "profile" in t:
        lines.append(f"  profile          {_rel(art('profile', 'profile_json')['uri'])}  (+ plot, HTML: "
                     f"{_rel(art('profile', 'plot')['uri'])}{cached('profile')})")
    if "plan" in t:
        lines.append(f"  plan             {par('plan', 'Output')}  {_rel(art('plan', 'plan_json')['uri'])}  "
                     f"(Markdown: {_rel(art('plan', 'report')['uri'])}{cached('plan')})")
    if "train" in t:
        m = art("train", "trained_model")
        lines.append(f"  trained model    {m['metadata'].get('uri', '?')}  (manifest sha256 "
                     f"{str(m['metadata'].get('manifest_sha256', ''))[:12]}..)")
        lines.append(f"    pointer        {_rel(m['uri'])}")
        met = art("train", "metrics")["metadata"]
        lines.append("    metrics        " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(met.items())))
    if "evaluate" in t:
        res = art("evaluate", "results")
        lines.append(
            f"  evaluation       {res['metadata'].get('output_uri', '')}  (images, metrics.json, report.html)"
        )
        lines.append(f"    report (HTML)  {_rel(art('evaluate', 'report')['uri'])}")
        met = art("evaluate", "metrics")["metadata"]
        lines.append("    metrics        " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(met.items())
                                                       if k.rsplit(".", 1)[-1] in ("trained", "base")))
    if "register" in t:
        reg = art("register", "registered")["metadata"]
        lines.append(
            f"  registered       {reg.get('uri', '?')}"
            f"{' (existing version, same weights)' if reg.get('reused') else ''}"
            f"  source {reg.get('source', '')}"
        )
    if "check-gate" in t:
        passed = par("check-gate", "Output")
        lines.append(
            f"  promotion gate   {'passed' if passed else 'not passed'} ({r.params.get('gate_metric')}, "
            f"{r.params.get('gate_direction')} is better)"
        )
        if "promote" in t:
            lines.append(f"  promote          {par('promote', 'Output')}  -> "
                         f"models:/{r.params.get('model_name')}@champion")
        else:
            lines.append("  promote          skipped (gate not passed); champion unchanged")
    if "check-regression" in t:
        lines.append(f"  regression       {'REGRESSION' if par('check-regression', 'Output') else 'none'}  "
                     f"(summary: {_rel(art('check-regression', 'summary')['uri'])})")
    lines += stage_lines(r.stages)
    s3 = env.get("CHUNKGRPO_S3_ENDPOINT", "")
    state = "still running" if r.services_kept else "stopped"
    lines.append(
        f"  services         S3 {s3} (bucket {env.get('CHUNKGRPO_S3_BUCKET', '')}), "
        f"MLflow {mlflow}: {state}"
    )
    home = _rel(str(r.run_dir.parent.parent / "local"))
    if r.services_kept:
        lines.append(
            "                   browse MLflow at the URL above; stop them with "
            f"`chunkgrpo local down --home {home}`"
        )
    else:
        lines.append(
            f"                   data kept in {home}; browse it again with "
            f"`chunkgrpo local up --home {home}` "
            "(or rerun with --keep-services)"
        )
    return lines
