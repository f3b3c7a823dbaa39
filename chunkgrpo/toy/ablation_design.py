"""The ablation's design, fixed before any run: the arms, equal budgets by construction, the pre-registered
primary endpoint and the power calculation (the module docstring of `chunkgrpo.toy.ablation` describes the
experiment).

**Equal budgets** (`design()` computes them from the configs and refuses a design where they differ):

* step and chunk arms make the same optimizer steps on the same rollouts (P·G images per step) and train
  the same expected number of transitions per sample: a chunk arm with K chunks training k = int(K·f)
  of them (uniformly) trains k/K·S of the S trainable steps on average; the step arms are given the
  `timestep_fraction` that trains exactly that many steps (N = 10: `[2, 3, 4]`, 2 of 3 chunks = 6 of 9
  steps; N = 17: `[2, 3, 4, 7]`, 2 of 4 chunks = 8 of 16 steps). Weighted sampling (`chunk_ws`) draws
  chunks by their dynamics, so its count is data-dependent: measured and reported, not matched;
* branching arms (TempFlow, Granular) score far more images per optimizer step; they are stopped at the
  same cumulative transformer samples as a step arm's run (`steps`·P·G·(N + T), T the matched transitions
  per sample), and every curve is also plotted against cumulative transformer samples.

`cfg` below is an `AblationConfig` (chunkgrpo.toy.ablation).
"""

from __future__ import annotations

from chunkgrpo.errors import UserError
from chunkgrpo.toy.power import min_detectable_effect, paired_power, seeds_needed

# per method: training overrides; `kind` step | chunk | branch; `chunks` the chunk strategy of a chunk arm
# ("{plan}" = the SDE dynamics plan, "{uniform}" = the config's uniform strategy);
# `weighted` = Eq. 16 sampling
ARMS: dict[str, dict] = {
    "step_flow": {"overrides": ["method=dance", "sampling.rule=flow", "sampling.eta=0.7"], "kind": "step"},
    "step_dance": {"overrides": ["method=dance", "sampling.rule=dance", "sampling.eta=0.3"], "kind": "step"},
    "chunk_uniform": {"overrides": ["method=chunk"], "kind": "chunk", "chunks": "{uniform}"},
    "chunk_dynamics": {"overrides": ["method=chunk"], "kind": "chunk", "chunks": "{plan}"},
    "chunk_ws": {"overrides": ["method=chunk+ws"], "kind": "chunk", "chunks": "{plan}", "weighted": True},
    "tempflow": {"overrides": ["method=tempflow"], "kind": "branch"},
    "granular": {"overrides": ["method=granular"], "kind": "branch"},
}
LABELS = {"step_flow": "step-level GRPO (flow)", "step_dance": "step-level GRPO (dance)",
          "chunk_uniform": "Chunk-GRPO, uniform", "chunk_dynamics": "Chunk-GRPO, SDE dynamics plan",
          "chunk_ws": "Chunk-GRPO + weighted sampling", "tempflow": "TempFlow-GRPO (equal samples)",
          "granular": "Granular-GRPO (equal samples)"}
PRIMARY = ("chunk_dynamics", "step_flow")
SECONDARY = [("chunk_uniform", "step_flow"), ("chunk_ws", "step_flow"), ("chunk_dynamics", "step_dance"),
             ("tempflow", "step_flow"), ("granular", "step_flow")]
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
PRIOR_SD = (
    0.053  # paired sd of chunk − step_flow over 5 seeds in the v1 ablation (benchmarks/results/ablation-toy)
)


def expected_transitions(sizes: list[int], fraction: float) -> float:
    """Expected trained transitions per sample when int(K·fraction) of K chunks are drawn uniformly (the
    engine's `select_units`): each chunk is drawn with probability k/K, so k/K·Σ sizes."""
    K = len(sizes)
    k = max(1, int(K * fraction))
    return k / K * sum(sizes)


def step_fraction(transitions: int, trainable_steps: int) -> float:
    """The `timestep_fraction` at which a step arm trains exactly `transitions` of `trainable_steps`
    (int(S·f) = T; the midpoint of the interval keeps float rounding away from the boundary)."""
    return (transitions + 0.5) / trainable_steps


def design(cfg, train_cfg, plan_sizes: list[int] | None) -> dict:
    """Each arm's chunk sizes, timestep_fraction, expected transitions per sample, rewarded images and
    transformer samples per optimizer step — equal by construction across the step and (unweighted) chunk
    arms; UserError when the configuration cannot make them equal."""
    from chunkgrpo.chunks import plan_chunks

    S = train_cfg.trainable_steps
    N = train_cfg.sampling.num_steps
    B = train_cfg.prompts_per_rank * train_cfg.group_size
    chunk_sizes: dict[str, list[int]] = {}
    for m in cfg.methods:
        spec = ARMS[m]
        if spec["kind"] != "chunk":
            continue
        if spec["chunks"] == "{plan}":
            if plan_sizes is None:
                raise UserError(f"{m} needs the dynamics plan")
            chunk_sizes[m] = list(plan_sizes)
        else:
            chunk_sizes[m] = plan_chunks(cfg.uniform, S).sizes
    matched = {m: expected_transitions(s, cfg.timestep_fraction) for m, s in chunk_sizes.items()
               if not ARMS[m].get("weighted")}
    T = matched[PRIMARY[0]]
    unequal = {m: t for m, t in matched.items() if abs(t - T) > 1e-9}
    if unequal:
        raise UserError(
            f"unequal budgets: {PRIMARY[0]} trains {T:g} transitions per sample but "
            + ", ".join(f"{m} (sizes {chunk_sizes[m]}) {t:g}" for m, t in unequal.items())
            + f" at timestep_fraction={cfg.timestep_fraction}; choose `uniform`/`timestep_fraction` "
            "so that int(K·f)/K·S is the same for every chunk arm"
        )
    if abs(T - round(T)) > 1e-9:
        raise UserError(
            f"{PRIMARY[0]} (sizes {chunk_sizes[PRIMARY[0]]}) trains {T:g} transitions per sample at "
            f"timestep_fraction={cfg.timestep_fraction}: a step arm trains a whole number of steps, "
            f"so no step arm can match it; change timestep_fraction or the plan"
        )
    T = int(round(T))
    budget = cfg.steps * B * (N + T)
    arms = {}
    for m in cfg.methods:
        spec = ARMS[m]
        if spec["kind"] == "step":
            f = step_fraction(T, S)
            arms[m] = {"kind": "step", "chunk_sizes": [1] * S, "timestep_fraction": f,
                       "transitions_per_sample": float(int(S * f)), "rewards_per_step": B,
                       "samples_per_step": B * (N + T), "optimizer_steps": cfg.steps}
        elif spec["kind"] == "chunk":
            sizes = chunk_sizes[m]
            k = max(1, int(len(sizes) * cfg.timestep_fraction))
            arms[m] = {"kind": "chunk", "chunk_sizes": sizes, "timestep_fraction": cfg.timestep_fraction,
                       "trained_chunks": k,
                       "transitions_per_sample": (None if spec.get("weighted")
                                                  else expected_transitions(sizes, cfg.timestep_fraction)),
                       "rewards_per_step": B, "samples_per_step": B * (N + T), "optimizer_steps": cfg.steps}
        else:
            arms[m] = {"kind": "branch", "chunk_sizes": [1] * S, "transitions_per_sample": None,
                       "sample_budget": budget, "optimizer_steps": None}
    return {
        "trainable_steps": S,
        "num_steps": N,
        "samples_per_step": B,
        "transitions_per_sample": T,
        "sample_budget": budget,
        "arms": arms,
        "rule": f"step/chunk arms: {cfg.steps} optimizer steps × {B} images, "
        f"{T} of {S} transitions per sample "
        f"in expectation; branching arms stop at {budget} cumulative transformer samples "
        f"(= {cfg.steps} × {B} × ({N} + {T}))",
    }


def power_plan(cfg, observed: dict | None = None) -> dict:
    """The pre-registered power calculation (and, with `observed` paired differences, the same at the
    measured sd): seeds for Δ ∈ {0.02, 0.03, 0.05}, power at the planned seeds, the minimum detectable
    effect at the planned and at the current number of seeds."""
    sd = cfg.assumed_sd
    n = cfg.primary_seeds()
    out = {"test": f"two-sided paired t, alpha {cfg.alpha}, power {cfg.power} (scipy noncentral t)",
           "assumed_sd": sd, "primary_delta": cfg.primary_delta, "planned_seeds": n,
           "power_at_planned": paired_power(n, cfg.primary_delta, sd, cfg.alpha) if n >= 2 else float("nan"),
           "seeds_for": {f"{d:g}": seeds_needed(d, sd, cfg.power, cfg.alpha) for d in (0.02, 0.03, 0.05)},
           "mde_at_planned": min_detectable_effect(n, sd, cfg.power, cfg.alpha)}
    if observed and observed.get("n", 0) >= 2 and observed.get("sd", 0) > 0:
        osd, on = observed["sd"], observed["n"]
        out["observed"] = {
            "sd": osd,
            "seeds": on,
            "mde": min_detectable_effect(on, osd, cfg.power, cfg.alpha),
            "seeds_for_primary_delta": seeds_needed(cfg.primary_delta, osd, cfg.power, cfg.alpha),
            "power_at_primary_delta": paired_power(on, cfg.primary_delta, osd, cfg.alpha),
        }
    return out


def primary_endpoint(cfg) -> dict:
    """The pre-registered primary comparison (written before any run, into config and results)."""
    return {"a": PRIMARY[0], "b": PRIMARY[1],
            "metric": "held-out GenEval overall accuracy (exact toy detector) at the final evaluation point",
            "estimand": f"mean over seeds of ({PRIMARY[0]} − {PRIMARY[1]}), paired by training seed",
            "test": f"two-sided paired t-test, alpha {cfg.alpha}; 95 % t confidence interval",
            "powered_for": {"delta": cfg.primary_delta, "sd": cfg.assumed_sd, "power": cfg.power,
                            "seeds": cfg.primary_seeds()},
            "sequential": ({"min_seeds": cfg.min_seeds, "max_seeds": cfg.max_seeds,
                            "stop": f"95 % CI excludes 0 or half-width < {cfg.stop_half_width}"}
                           if cfg.sequential else None),
            "secondary": [f"{a} − {b}" for a, b in SECONDARY if a in cfg.methods and b in cfg.methods],
            "secondary_correction": "Holm (step-down) over the secondary comparisons present"}
