"""Which preset reproduces which published recipe (no torch import: the launcher image uses it too).

The value-by-value comparison of every preset with the script it reproduces is in docs/recipes.md.
"""

from __future__ import annotations

from chunkgrpo.errors import UserError

# The training methods: the one list of their names, and their families. `chunkgrpo.train.methods` maps
# each name to its implementation; `TrainConfig.method` accepts exactly these.
METHOD_NAMES = ("chunk", "chunk+ws", "dance", "tempflow", "granular")
CHUNK_METHODS = ("chunk", "chunk+ws")  # train chunks of the `chunks` plan
GRPO_METHODS = ("chunk", "chunk+ws", "dance")  # one rollout, units (chunks; steps for dance) per sample
BRANCHING_METHODS = ("tempflow", "granular")  # branch at single steps; ignore `chunks`
assert set(GRPO_METHODS) | set(BRANCHING_METHODS) == set(METHOD_NAMES)

# The preset each method trains with when none is named (pipeline `preset=''`): the method's published
# recipe; `dance` gets the Chunk-GRPO paper's step-level baseline (DanceGRPO's own recipe: dance_grpo_flux).
METHOD_PRESETS = {"chunk": "chunk_grpo_flux", "chunk+ws": "chunk_grpo_ws_flux", "dance": "step_grpo_flux",
                  "tempflow": "tempflow_grpo_flux", "granular": "granular_grpo_flux"}

# preset -> what it reproduces (shown by `chunkgrpo train --help-config` readers and the docs)
REPRODUCES = {
    "chunk_grpo_flux": (
        "Chunk-GRPO paper Table 1 'Chunk-GRPO w/o ws'; GCPO scripts/finetune/finetune_hpsv3_chunk.sh"
    ),
    "chunk_grpo_ws_flux": (
        "Chunk-GRPO paper Table 1 'Chunk-GRPO w/ ws'; GCPO finetune_hpsv3_chunk.sh + --sample_weight"
    ),
    "step_grpo_flux": "Chunk-GRPO paper Table 1 'Dance-GRPO' (the authors' baseline); GCPO finetune_hpsv3.sh",
    "dance_grpo_flux": "DanceGRPO scripts/finetune/finetune_flux_grpo_8gpus.sh",
    "tempflow_grpo_flux": "TempFlow-GRPO scripts/train_flux_pr.py with config/dgx.py:flux_pr",
    "granular_grpo_flux": "G2RPO paper Table 1 'G2RPO'; scripts/finetune/finetune_g2rpo_hps_clip.sh",
}


def preset_for(method: str, preset: str = "") -> str:
    """`preset`, or the method's own preset when it is empty."""
    if preset:
        return preset
    if method not in METHOD_PRESETS:
        raise UserError(f"method={method!r} is not one of {list(METHOD_NAMES)}")
    return METHOD_PRESETS[method]
