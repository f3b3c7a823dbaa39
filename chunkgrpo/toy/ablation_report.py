"""The ablation's report from its cached runs: per-method accuracy and budgets, paired comparisons (the
pre-registered primary, Holm-corrected secondaries), learning curves and the power calculation
(`aggregate` -> the `ablation.json` document, format `FORMAT`), its Markdown (`markdown`) and the PNGs
(`plot_curves`: training reward; `plot_learning_curves`: the primary difference per point, held-out
accuracy and training reward against cumulative transformer samples). Reads runs; never trains.
"""

from __future__ import annotations

import math
from pathlib import Path

from chunkgrpo.toy.ablation_design import LABELS, PRIMARY, SECONDARY, TAGS, power_plan, primary_endpoint
from chunkgrpo.toy.power import eval_sd, holm, mean_ci, min_detectable_effect, sequential_decision

FORMAT = "chunkgrpo.toy-ablation/v2"


def _curve_stats(rs: list[dict], base: dict[int, dict]) -> list[dict]:
    """Per evaluation point (0 = the base model): mean ± CI of accuracy, mean samples / steps / rewards."""
    pts = sorted({c["point"] for r in rs for c in r.get("curve", [])})
    out = []
    b0 = [base[r["seed"]]["overall"] for r in rs if r["seed"] in base]
    if b0:
        out.append({"point": 0, "overall": mean_ci(b0), "transformer_samples": 0.0, "optimizer_step": 0.0,
                    "rewards": 0.0})
    for j in pts:
        cs = [c for r in rs for c in r.get("curve", []) if c["point"] == j]
        out.append({"point": j, "overall": mean_ci([c["overall"] for c in cs]),
                    "transformer_samples": sum(c["transformer_samples"] for c in cs) / len(cs),
                    "optimizer_step": sum(c["optimizer_step"] for c in cs) / len(cs),
                    "rewards": sum(c["rewards"] for c in cs) / len(cs)})
    return out


def _point_value(run: dict, point: int, base: dict | None) -> float | None:
    if point == 0:
        return base["overall"] if base else None
    for c in run.get("curve", []):
        if c["point"] == point:
            return c["overall"]
    return None


def aggregate(cfg, runs: dict[str, dict[int, dict]], des: dict) -> dict:
    """Per method: accuracy per category and overall at the endpoint (mean ± 95 % CI over seeds), learning
    curve, budget; paired comparisons (primary + Holm-corrected secondaries); the power calculation.
    `cfg` an AblationConfig, `runs` the cached runs by method and seed, `des` the design (`design()`)."""
    base = runs.get("base", {})
    methods = {}
    for m in ["base", *cfg.methods]:
        by_seed = runs.get(m, {})
        if not by_seed:
            continue
        rs = [by_seed[s] for s in sorted(by_seed)]
        entry = {"label": LABELS.get(m, "base model"), "seeds": sorted(by_seed),
                 "overall": mean_ci([r["overall"] for r in rs]),
                 "tasks": {t: mean_ci([r["tasks"][t] for r in rs if t in r["tasks"]]) for t in TAGS}}
        if m != "base":
            entry["gain"] = mean_ci(
                [by_seed[s]["overall"] - base[s]["overall"] for s in sorted(by_seed) if s in base]
            )
            entry["wall_s"] = mean_ci([r["wall_s"] for r in rs])
            entry["train_cpu_s"] = mean_ci([r["train_cpu_s"] for r in rs])
            entry["transformer_samples"] = mean_ci([r["transformer_samples"] for r in rs])
            entry["rewards"] = mean_ci([r["rewards"] for r in rs])
            tps = [r["transitions_per_sample"] for r in rs if r.get("transitions_per_sample") is not None]
            entry["transitions_per_sample"] = mean_ci(tps) if tps else None
            entry["optimizer_steps"] = sorted({r["optimizer_steps"] for r in rs})
            entry["chunk_sizes"] = rs[0]["chunk_sizes"]
            entry["design"] = des["arms"][m]
            entry["curve"] = _curve_stats(rs, base)
            curves = [{st: rew for st, rew, *_ in r["reward_curve"]} for r in rs]
            samples = [{st: x[0] for st, _, *x in r["reward_curve"] if x} for r in rs]
            steps = sorted(set().union(*curves))
            entry["reward_curve"] = []
            for st in steps:
                c = mean_ci([cv[st] for cv in curves if st in cv])
                xs = [sv[st] for sv in samples if st in sv]
                entry["reward_curve"].append(
                    (st, c["mean"], c.get("sd", 0.0), sum(xs) / len(xs) if xs else None)
                )
        methods[m] = entry
    paired = []
    for role, (a, b) in [("primary", PRIMARY), *[("secondary", p) for p in SECONDARY]]:
        if a not in runs or b not in runs:
            continue
        common = sorted(set(runs[a]) & set(runs[b]))
        if not common:
            continue
        diffs = [runs[a][s]["overall"] - runs[b][s]["overall"] for s in common]
        pts = sorted({c["point"] for s in common for c in runs[a][s].get("curve", [])})
        per_point = []
        for j in ([0] if base else []) + pts:
            vals = {}
            for s in common:
                va = _point_value(runs[a][s], j, base.get(s))
                vb = _point_value(runs[b][s], j, base.get(s))
                if va is not None and vb is not None:
                    vals[s] = va - vb
            per_point.append({"point": j, "diff": mean_ci(list(vals.values())), "by_seed": vals})
        paired.append({"a": a, "b": b, "role": role, "seeds": common, "diff": mean_ci(diffs),
                       "wins": sum(d > 0 for d in diffs), "ties": sum(d == 0 for d in diffs),
                       "losses": sum(d < 0 for d in diffs), "curve": per_point})
    sec = [p for p in paired if p["role"] == "secondary"]
    for p, adj in zip(sec, holm([p["diff"].get("p", float("nan")) for p in sec])):
        p["p_holm"] = adj
    prim = next((p for p in paired if p["role"] == "primary"), None)
    primary = {**primary_endpoint(cfg), "planned_seeds": cfg.primary_seeds()}
    if prim:
        d = prim["diff"]
        primary.update(
            {
                "seeds": prim["seeds"],
                "diff": d,
                "ci": [d["mean"] - d["ci95"], d["mean"] + d["ci95"]] if d["n"] >= 2 else None,
                "mde_at_seeds": min_detectable_effect(d["n"], d.get("sd", float("nan")), cfg.power, cfg.alpha)
                if d["n"] >= 2
                else float("nan"),
                "mde_at_seeds_assumed_sd": min_detectable_effect(d["n"], cfg.assumed_sd, cfg.power, cfg.alpha)
                if d["n"] >= 2
                else float("nan"),
            }
        )
        stop, why = sequential_decision(
            [d_ for d_ in d["values"]],
            min_seeds=cfg.min_seeds if cfg.sequential else cfg.primary_seeds(),
            max_seeds=cfg.max_seeds if cfg.sequential else cfg.primary_seeds(),
            half_width=cfg.stop_half_width,
        )
        primary["status"] = "final" if stop else "interim"
        primary["status_reason"] = why
    else:
        primary.update({"seeds": [], "status": "interim", "status_reason": "no paired seed finished yet"})
    power = power_plan(cfg, prim["diff"] if prim else None)
    evsd = None
    if "base" in methods and base:
        r0 = next(iter(base.values()))
        acc = {t: methods["base"]["tasks"][t]["mean"] for t in TAGS if t in r0.get("images", {})}
        evsd = {
            "base_overall_sd": eval_sd(acc, r0.get("images", {})),
            "images_per_eval": r0.get("n_images"),
            "note": "binomial sd of one evaluation's overall score at the base model's per-category accuracy",
        }
    return {"format": FORMAT, "methods": methods, "paired": paired, "primary": primary, "power": power,
            "design": des, "eval_noise": evsd, "tags": list(TAGS)}


def nightly_summary(result: dict, key: str, seeds_now: list[int]) -> str:
    """The one-line summary of a nightly series (`run_series`): seeds so far, the primary difference, the
    MDE."""
    pr = result["primary"]
    return (
        f"series {key}: {len(seeds_now)} seeds so far "
        f"({len(result['series']['seeds_added'])} added tonight); "
        f"{pr['a']} − {pr['b']} = "
        + (
            f"{pr['diff']['mean']:+.4f} ± {pr['diff']['ci95']:.4f}"
            if pr.get("diff") and pr["diff"]["n"] >= 2
            else "n/a (< 2 seeds)"
        )
        + f"; minimum detectable effect at {len(seeds_now)} seeds: "
        f"{_f(pr.get('mde_at_seeds'), 4)} (observed sd), "
        f"{_f(pr.get('mde_at_seeds_assumed_sd'), 4)} (pre-registered sd)"
    )


def _pm(c: dict | None, digits: int = 3) -> str:
    if not c or c.get("n", 0) == 0:
        return "–"
    if c["n"] < 2 or not math.isfinite(c["ci95"]):
        return f"{c['mean']:.{digits}f}"
    return f"{c['mean']:.{digits}f} ± {c['ci95']:.{digits}f}"


def _f(x, digits: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def _powered_line(pf: dict, power: dict) -> str:
    """The design's seed count against the power calculation: "powered for" only when it is; a fixed,
    smaller count (the N = 17 setting) says its power instead."""
    needed = (power.get("seeds_for") or {}).get(str(pf["delta"]))
    if needed is not None and pf["seeds"] < needed:
        at_planned = power.get("power_at_planned", float("nan"))
        return (f"- Seeds fixed at {pf['seeds']}, fewer than the {needed} that Δ = {pf['delta']} needs "
                f"at paired sd {pf['sd']} ({pf['power']:.0%} power): power {at_planned:.2f}, "
                "a check of the direction, not a powered test.")
    return (f"- Powered for Δ = {pf['delta']} at paired sd {pf['sd']} ({pf['power']:.0%} power): "
            f"{pf['seeds']} seeds.")


def markdown(result: dict) -> str:
    s = result["settings"]
    tc = s["train_config"]
    pr, pw, des = result["primary"], result["power"], result["design"]
    status = pr.get("status", "interim").upper()
    lines = [
        f"# Toy-world ablation: chunk vs step, budget-matched ({status})",
        "",
        f"**Status: {status}** — {pr.get('status_reason', '')}. Primary pair: {len(pr.get('seeds', []))} of "
        f"{pr['planned_seeds']} planned seeds.",
        "",
        f"Base model `{result['model']['key']}`; "
        f"{tc['prompts_per_rank']} prompts × {tc['group_size']} samples "
        f"per optimizer step; {tc['sampling']['num_steps']} sampling steps at {tc['sampling']['height']}²; "
        f"lr {tc['lr']}, LoRA r{tc['lora']['rank']}; reward `toy_geneval` (graded credit). Evaluation: "
        f"{len(s['eval_prompts'])} held-out prompts × {s['eval_samples']} images "
        f"at {s['eval_points']} points per "
        "run, trained model alone, ODE, the same noise for every arm of a seed. "
        "Mean ± 95 % CI (t) over seeds.",
        "",
    ]
    if pr.get("nightly_summary"):
        lines += [f"**Nightly series** — {pr['nightly_summary']}.", ""]
    if result.get("plan"):
        lines += [f"Dynamics plan (engine profile on **{result['plan'].get('trajectories', '?').upper()}** "
                  f"trajectories + `{s['plan']}`): chunk sizes {result['plan']['sizes']}.", ""]
    lines += [
        "## Pre-registered primary endpoint",
        "",
        f"- {pr['metric']}; {pr['estimand']}; {pr['test']}.",
        _powered_line(pr["powered_for"], result.get("power") or {}),
        f"- Secondary ({pr['secondary_correction']}): " + ", ".join(f"`{x}`" for x in pr["secondary"]) + ".",
    ]
    if pr.get("sequential"):
        q = pr["sequential"]
        lines.append(
            f"- Sequential: from {q['min_seeds']} seeds, stop when {q['stop']} (at most {q['max_seeds']})."
        )
    if pr.get("diff"):
        d = pr["diff"]
        ci = pr.get("ci")
        lines += [
            "",
            f"**Primary result** (`{pr['a']}` − `{pr['b']}`, {d['n']} seeds): "
            f"{_pm(d, 4)}"
            + (f" (95 % CI [{ci[0]:+.4f}, {ci[1]:+.4f}], p = {d.get('p', float('nan')):.3g})" if ci else "")
            + f"; minimum detectable effect at {d['n']} seeds (80 % power): "
            f"{_f(pr.get('mde_at_seeds'), 4)} at the "
            f"observed sd, {_f(pr.get('mde_at_seeds_assumed_sd'), 4)} at the pre-registered sd.",
        ]
    lines += ["", "## Power calculation (scipy, " + pw["test"] + ")", "",
              f"Pre-registered paired sd {pw['assumed_sd']} (v1 ablation, 5 seeds). Seeds needed: "
              + ", ".join(f"Δ = {k}: {v}" for k, v in pw["seeds_for"].items())
              + f". Planned {pw['planned_seeds']} seeds: power {_f(pw['power_at_planned'], 3)} at Δ = "
                f"{pw['primary_delta']}, minimum detectable effect {_f(pw['mde_at_planned'], 4)}."]
    if pw.get("observed"):
        o = pw["observed"]
        lines.append(f"Observed so far: paired sd {o['sd']:.4f} over {o['seeds']} seeds → power "
                     f"{o['power_at_primary_delta']:.3f} at Δ = {pw['primary_delta']}, MDE {o['mde']:.4f}; "
                     f"seeds for Δ = {pw['primary_delta']} at this sd: {o['seeds_for_primary_delta']}.")
    if result.get("eval_noise") and result["eval_noise"].get("base_overall_sd") is not None:
        e = result["eval_noise"]
        lines.append(
            f"Evaluation noise: {e['images_per_eval']} images per evaluation, binomial sd of the overall "
            f"score ≈ {_f(e['base_overall_sd'], 4)} at the base model's accuracies."
        )
    lines += [
        "",
        "## Budgets (from the configs; measured means in parentheses)",
        "",
        des["rule"] + ".",
        "",
        "| arm | chunks | fraction | transitions / sample | optimizer steps | rewarded images "
        "| transformer samples |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, a in des["arms"].items():  # every arm of the design, with the measured means once it has runs
        e = result["methods"].get(m, {})
        tps = a.get("transitions_per_sample")
        meas = e.get("transitions_per_sample")
        tcol = (
            f"{tps:g}"
            if tps is not None
            else "weighted"
            if a["kind"] == "chunk"
            else "one per branching step"
        ) + (f" ({meas['mean']:.2f})" if meas else "")
        frac = f"{a['timestep_fraction']:.4g}" if a.get("timestep_fraction") else "–"
        steps = (f"{a['optimizer_steps']}" if a.get("optimizer_steps") else "until the sample budget") + (
            f" ({'/'.join(map(str, e['optimizer_steps']))})" if e.get("optimizer_steps") else "")
        rew = (f"{a['rewards_per_step'] * a['optimizer_steps']}" if a.get("rewards_per_step") else "–") + (
            f" ({e['rewards']['mean']:.0f})" if e.get("rewards") else "")
        smp = (f"≤ {a['samples_per_step'] * a['optimizer_steps']}" if a.get("samples_per_step")
               else f"{a['sample_budget']}") + (f" ({e['transformer_samples']['mean']:.0f})"
                                                  if e.get("transformer_samples") else "")
        chunks = a["chunk_sizes"] if a["kind"] == "chunk" else a["kind"]
        lines.append(f"| `{m}` | {chunks} | {frac} | {tcol} | {steps} | {rew} | {smp} |")
    head = [
        "method",
        "seeds",
        "overall (final)",
        *[t.replace("_", " ") for t in result["tags"]],
        "gain vs base",
        "wall s",
    ]
    lines += [
        "",
        "## Held-out accuracy at the endpoint",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for m, e in result["methods"].items():
        row = [e["label"] + ("" if m == "base" else f" (`{m}`)"), str(len(e["seeds"])), _pm(e["overall"]),
               *[_pm(e["tasks"][t], 2) for t in result["tags"]]]
        row += ["–", "–"] if m == "base" else [_pm(e["gain"]), f"{e['wall_s']['mean']:.0f}"]
        lines.append("| " + " | ".join(row) + " |")
    if result["paired"]:
        lines += ["", "## Paired comparisons (same training seed, same evaluation noise)", "",
                  "| comparison | role | seeds | mean diff ± 95 % CI | p | p (Holm) | wins / ties / losses |",
                  "|---|---|---|---|---|---|---|"]
        for p in result["paired"]:
            lines.append(
                f"| `{p['a']}` − `{p['b']}` | {p['role']} | {len(p['seeds'])} | {_pm(p['diff'], 4)} | "
                f"{_f(p['diff'].get('p'), 3)} | "
                f"{_f(p.get('p_holm'), 3) if p['role'] != 'primary' else '–'} | "
                f"{p['wins']} / {p['ties']} / {p['losses']} |"
            )
    curves = [(m, e) for m, e in result["methods"].items() if m != "base" and e.get("curve")]
    if curves:
        npts = max(len(e["curve"]) for _, e in curves)
        lines += [
            "",
            "## Learning curves (held-out accuracy per evaluation point; point 0 = base model)",
            "",
            "| method | " + " | ".join(f"point {j}" for j in range(npts)) + " |",
            "|---|" + "---|" * npts,
        ]
        for m, e in curves:
            cells = [f"{_pm(c['overall'])} @ {c['transformer_samples']:.0f} samples" for c in e["curve"]]
            lines.append(f"| `{m}` | " + " | ".join(cells + ["–"] * (npts - len(cells))) + " |")
    lines += [
        "",
        f"Computed runs this invocation: {result.get('computed_runs')}; elapsed {result.get('elapsed_s')} s.",
        "",
    ]
    return "\n".join(lines)


def plot_curves(result: dict, path: Path) -> Path | None:
    """Training reward (mean over seeds, ± sd band) per optimizer step, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    any_curve = False
    for i, (m, e) in enumerate(result["methods"].items()):
        curve = e.get("reward_curve")
        if not curve:
            continue
        x = [c[0] for c in curve]
        y = [c[1] for c in curve]
        sd = [c[2] if c[2] == c[2] else 0.0 for c in curve]
        ax.plot(x, y, label=e["label"], color=f"C{i}", marker="." if len(x) < 30 else None)
        ax.fill_between(
            x, [a - b for a, b in zip(y, sd)], [a + b for a, b in zip(y, sd)], color=f"C{i}", alpha=0.12
        )
        any_curve = True
    if not any_curve:
        plt.close(fig)
        return None
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training reward (toy_geneval, graded)")
    ax.set_title("Toy-world ablation: training reward (mean ± sd over seeds)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_learning_curves(result: dict, path: Path) -> Path | None:
    """Three panels: (1) the primary paired difference per evaluation point, one thin line per seed and the
    mean ± 95 % CI; (2) held-out accuracy (mean ± 95 % CI) of every arm against cumulative transformer
    samples; (3) the training reward against cumulative transformer samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prim = next((p for p in result["paired"] if p["role"] == "primary"), None)
    arms = [(m, e) for m, e in result["methods"].items() if m != "base" and e.get("curve")]
    if not arms:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), dpi=100)
    ax = axes[0]
    if prim and prim["curve"]:
        pts = [c["point"] for c in prim["curve"]]
        for s in prim["seeds"]:
            ys = [c["by_seed"].get(s, c["by_seed"].get(str(s))) for c in prim["curve"]]
            ax.plot(pts, ys, color="grey", alpha=0.35, linewidth=0.8)
        m_ = [c["diff"]["mean"] for c in prim["curve"]]
        h = [
            c["diff"]["ci95"] if math.isfinite(c["diff"].get("ci95", float("nan"))) else 0.0
            for c in prim["curve"]
        ]
        ax.plot(
            pts,
            m_,
            color="C3",
            linewidth=2.2,
            marker="o",
            label=f"mean ± 95 % CI ({len(prim['seeds'])} seeds)",
        )
        ax.fill_between(
            pts, [a - b for a, b in zip(m_, h)], [a + b for a, b in zip(m_, h)], color="C3", alpha=0.2
        )
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_title(f"primary: {prim['a']} − {prim['b']} (per seed, paired)", fontsize=9)
        ax.legend(fontsize=7)
    ax.set_xlabel("evaluation point (0 = base model)")
    ax.set_ylabel("Δ held-out accuracy")
    ax = axes[1]
    for i, (m, e) in enumerate(arms):
        x = [c["transformer_samples"] for c in e["curve"]]
        y = [c["overall"]["mean"] for c in e["curve"]]
        h = [
            c["overall"]["ci95"] if math.isfinite(c["overall"].get("ci95", float("nan"))) else 0.0
            for c in e["curve"]
        ]
        ax.plot(x, y, marker="o", color=f"C{i}", label=f"{m} ({len(e['seeds'])})")
        ax.fill_between(
            x, [a - b for a, b in zip(y, h)], [a + b for a, b in zip(y, h)], color=f"C{i}", alpha=0.12
        )
    ax.set_xlabel("cumulative transformer samples")
    ax.set_ylabel("held-out accuracy (mean ± 95 % CI)")
    ax.set_title("learning curves, equal budgets", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[2]
    for i, (m, e) in enumerate(arms):
        rc = [c for c in e.get("reward_curve", []) if c[3] is not None]
        if rc:
            ax.plot([c[3] for c in rc], [c[1] for c in rc], color=f"C{i}", label=m, linewidth=1)
    ax.set_xlabel("cumulative transformer samples")
    ax.set_ylabel("training reward (mean over seeds)")
    ax.set_title("training reward", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
