"""Chunk planning: a dynamics profile -> the chunk plan (JSON, PNG) and the trainer's `sizes:` spec."""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Plan:
    """A written chunk plan."""

    data: dict             # the plan (chunkgrpo.chunks: sizes, chunks, rationale, trajectories, ...)
    path: Path             # its JSON file
    plot: Path | None      # the PNG of both curves with the chunks (None when not drawn)

    @property
    def sizes(self) -> list[int]:
        return [int(s) for s in self.data["sizes"]]

    @property
    def spec(self) -> str:
        """The plan as the trainer's `chunks` spec."""
        return "sizes:" + ",".join(str(s) for s in self.sizes)

    def markdown(self, chunks: str) -> str:
        """A summary for the KFP UI: the spec, the sizes, the rationale and a table of the chunks."""
        d = self.data
        rows = "\n".join(f"| {c['index']} | {c['steps'][0]}-{c['steps'][1]} | {c['size']} |"
                         for c in d["chunks"])
        rationale = d.get("rationale") or ""
        return (f"# Chunk plan\n\n**chunks** `{chunks}` -> **sizes** `{self.sizes}` "
                f"({d['trainable_steps']} trainable steps of {d['num_steps']}, planned on the "
                f"{d['trajectories'].upper()} profile)\n\n"
                f"{rationale if isinstance(rationale, str) else json.dumps(rationale)}\n\n"
                f"| chunk | steps | size |\n|---|---|---|\n{rows}\n")


    def html(self, chunks: str) -> str:
        """A page for the KFP UI's visualisation: the plot of both curves with the chunks, the spec, the
        rationale and the chunks table."""
        from chunkgrpo.stages.profile import html_page

        d = self.data
        rationale = d.get("rationale") or ""
        rationale = rationale if isinstance(rationale, str) else json.dumps(rationale)
        rows = "".join(f"<tr><td>{c['index']}</td><td>{c['steps'][0]}-{c['steps'][1]}</td>"
                       f"<td>{c['size']}</td></tr>" for c in d["chunks"])
        about = (f"chunks {chunks} -> sizes {self.sizes} ({d['trainable_steps']} trainable steps of "
                 f"{d['num_steps']}, planned on the {str(d['trajectories']).upper()} profile)")
        return html_page("Chunk plan", f"<p>{html.escape(about)}</p>", f"<p>{html.escape(rationale)}</p>",
                         f"<table><tr><th>chunk</th><th>steps</th><th>size</th></tr>{rows}</table>",
                         png=self.plot)


def plan(profile: str | Path, chunks: str, out: str | Path, trajectories: str | None = None) -> Plan:
    """Segment the profile's trainable steps by `chunks` (dynamics[:...] | uniform:N | sizes:.. | step |
    whole) on its SDE or ODE curve (default: the profile's); writes `out` and the PNG next to it."""
    from chunkgrpo.chunks import plan_from_profile

    d, path = plan_from_profile(profile, chunks, out, trajectories=trajectories)
    png = path.with_suffix(".png")
    return Plan(d, path, png if png.exists() else None)
