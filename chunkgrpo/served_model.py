"""The registered model as an MLflow `python_function`: base FLUX pipeline + the trained weights,
generating with the hybrid inference it was evaluated with.

    model = mlflow.pyfunc.load_model("models:/chunkgrpo-flux@champion")
    out = model.predict(pd.DataFrame({"prompt": ["a red apple", "a blue car"], "seed": [1, 2]}),
                        params={"mode": "hybrid"})      # or "trained" / "base"
    out["image"][0]                                     # PNG, base64

`chunkgrpo.registry.registration.register_model` saves every version this way ("model from code": the
MLflow Model holds `served_model_entry.py`, which imports this module; no pickled objects). The version's
artifact `model/` holds the weights (or a checksum-pinned pointer to them in S3) and
`chunkgrpo_registration.json` with the base model and the sampling settings of the evaluation; that
format, the signature and the predict() parameters' defaults are `chunkgrpo.registry.payload`'s.

Environment of the serving process: the version's pinned requirements (`payload.serving_requirements`;
`chunkgrpo` itself comes with the version, `code/chunkgrpo`), the base model reachable (an `s3://` folder
artifact with S3 credentials, a folder, or the hub cache; `CHUNKGRPO_BASE_MODEL` overrides the registered
reference, e.g. with a local copy), `CHUNKGRPO_DEVICE` (default: cuda if available, else cpu).
"""

from __future__ import annotations

import base64
import io
import json
import os
import warnings
from pathlib import Path

import mlflow.pyfunc

from chunkgrpo.registry.payload import MODEL_INFO, PARAM_DEFAULTS, weights_from_payload

# predict() takes a DataFrame and typed params (payload.signature()); MLflow's type-hint validation is unused
warnings.filterwarnings("ignore", message=".*Add type hints to the `predict` method.*")

OUTPUT_COLUMNS = ("prompt", "seed", "image")


def _png_b64(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def decode_image(text: str):
    """The PIL image of one `image` cell of predict()'s output."""
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(text))).convert("RGB")


class FluxPyfunc(mlflow.pyfunc.PythonModel):
    """Loads once per process (`load_context`), then `predict` generates one image per row."""

    def load_context(self, context) -> None:
        import torch

        from chunkgrpo.eval.hybrid import HybridConfig, HybridSampler, load_trained

        payload = Path(context.artifacts["model"])
        self.info = json.loads((payload / MODEL_INFO).read_text())
        weights = weights_from_payload(payload, self.info)
        device = os.environ.get("CHUNKGRPO_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        base = os.environ.get("CHUNKGRPO_BASE_MODEL") or self.info["base_model"]
        self.trained = load_trained(weights)
        self.sampler = HybridSampler.load(base, self.trained, device=device, dtype=dtype)
        sampling = {
            k: v
            for k, v in (self.info.get("sampling") or {}).items()
            if k in HybridConfig.__dataclass_fields__
        }
        self.base_cfg = HybridConfig(**sampling)

    def _cfg(self, params: dict):
        from chunkgrpo.eval.hybrid import HybridConfig

        cfg = self.base_cfg.to_dict()
        for key in ("num_steps", "height", "width"):
            if int(params.get(key, 0)) > 0:
                cfg[key] = int(params[key])
        if int(params.get("trained_steps", -1)) >= 0:
            cfg["trained_steps"] = int(params["trained_steps"])
        if float(params.get("guidance", -1.0)) >= 0:
            cfg["guidance"] = float(params["guidance"])
        cfg["trained_steps"] = min(cfg["trained_steps"], cfg["num_steps"])
        return HybridConfig(**cfg)

    def predict(self, context, model_input, params: dict | None = None):
        import pandas as pd

        from chunkgrpo.errors import UserError

        p = {**PARAM_DEFAULTS, **(params or {})}
        if p["mode"] not in ("hybrid", "trained", "base"):
            raise UserError(f"mode={p['mode']!r} must be hybrid, trained or base")
        df = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        if "prompt" not in df.columns:
            raise UserError("predict() needs a `prompt` column")
        prompts = [str(x) for x in df["prompt"]]
        if "seed" in df.columns:
            seeds = [int(s) if pd.notna(s) else int(p["seed"]) + i for i, s in enumerate(df["seed"])]
        else:
            seeds = [int(p["seed"]) + i for i in range(len(prompts))]
        images = self.sampler.generate(
            prompts, seeds, self._cfg(p), mode=p["mode"], batch_size=int(p["batch_size"])
        )
        return pd.DataFrame({"prompt": prompts, "seed": seeds, "image": [_png_b64(im) for im in images]})
