"""Dynamics profiling: SDE (training) and ODE trajectories of the base model -> per-step L1rel profile
(JSON + PNG) that the planner reads."""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Profile:
    """A written profile."""

    data: dict             # the profile (chunkgrpo.dynamics: sigmas, l1rel, trajectories, ...)
    path: Path             # its JSON file
    plot: Path | None      # the PNG of the curves (None when not drawn)

    def html(self, model: str = "") -> str:
        """A page for the KFP UI's visualisation: the plot, the settings and the per-step L1rel values."""
        d = self.data
        kind = str(d.get("trajectories") or "ode")
        curves = {k: d[f"l1rel_{k}"] for k in ("sde", "ode") if d.get(f"l1rel_{k}")} or {kind: d["l1rel"]}
        head = "".join(f"<th>L1rel {k.upper()}{' (planned on)' if k == kind else ''}</th>" for k in curves)
        rows = "".join(f"<tr><td>{i}</td>" + "".join(f"<td>{_num(c, i)}</td>" for c in curves.values())
                       + "</tr>" for i in range(max(len(c) for c in curves.values())))
        about = (f"{len(d['l1rel'])} sampling steps, {d.get('samples', '?')} trajectories each"
                 + (f", model {model}" if model else "") + f"; the planner reads the {kind.upper()} curve")
        return html_page("Dynamics profile", f"<p>{html.escape(about)}</p>",
                         f"<table><tr><th>step</th>{head}</tr>{rows}</table>", png=self.plot)


def _num(values: list, i: int) -> str:
    return f"{float(values[i]):.4g}" if i < len(values) and isinstance(values[i], (int, float)) else ""


def html_page(title: str, *parts: str, png: Path | None = None) -> str:
    """A self-contained HTML page (the KFP UI renders an HTML artifact as is): the title, the PNG embedded
    as a base64 `<img>` (no file beside it to fetch), then the HTML `parts`."""
    img = ""
    if png is not None and Path(png).exists():
        data = base64.b64encode(Path(png).read_bytes()).decode("ascii")
        img = f'<img src="data:image/png;base64,{data}" alt="{html.escape(title)}" style="max-width:100%">'
    style = ("<style>body{font-family:sans-serif}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}</style>")
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>{style}"
            f"</head><body><h1>{html.escape(title)}</h1>{img}{''.join(parts)}</body></html>\n")


def training_config(*, model: str, prompts: str, preset: str, method: str, overrides: list,
                    num_prompts: int, seeds: int, device: str, trajectories: str, out: str | Path,
                    scratch: str | Path = ""):
    """The ProfileConfig that profiles a training preset's sampling (its `sampling` section with the
    `sampling.*` overrides); device `auto` is resolved by `run_profile` (chunkgrpo.gpu.require: a
    GPU the pod was granted but CUDA cannot use is an error, never a silent CPU profile). An s3:// prompt
    file is downloaded into the caller's `scratch` folder ('' = a new temp folder)."""
    from chunkgrpo.dynamics import ProfileConfig
    from chunkgrpo.recipes import preset_for
    from chunkgrpo.stages.task import local_file
    from chunkgrpo.train.config import TrainConfig

    preset = preset_for(method, preset)
    sampling = TrainConfig.load(preset, [o for o in overrides if o.startswith("sampling.")]).sampling
    return ProfileConfig.from_dict({"model": model, "prompts": local_file(prompts, scratch), "out": str(out),
                                    "num_prompts": num_prompts, "seeds": seeds, "device": device,
                                    "trajectories": trajectories, "sampling": sampling.to_dict()})


def profile(cfg, progress: bool = True) -> Profile:
    """Profile a ProfileConfig (load the model and prompts, sample, write JSON + PNG)."""
    from chunkgrpo.dynamics import run_profile

    data, path = run_profile(cfg, progress=progress)
    png = path.with_suffix(".png")
    return Profile(data, path, png if png.exists() else None)
