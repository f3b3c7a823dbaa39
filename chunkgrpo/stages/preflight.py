"""Preflight: fail a run in seconds, with one line naming every problem, before any GPU is requested."""

from __future__ import annotations

from pathlib import Path


def preflight(*, model: str, prompts: str, preset: str, method: str, train_overrides: list,
              reward_weights: dict, scorer_weights: dict, eval_preset: str, eval_benchmarks: list,
              eval_overrides: list, artifact_root: str, pool: str, capacity_out: str | Path,
              reward_url: str = "", chunks: str = "", nodes: int = 1, max_iterations: int = 0) -> str:
    """Check the `chunks` spec, the training config (preset + overrides + `max_iterations`, as the train
    step will load it), the base model, prompts, the reward/scorer weights the presets use, the
    reward servers (each reward's url, else `reward_url`), that this (the training) image builds every
    other training reward (`chunkgrpo.preflight_image`), S3, MLflow, the judge key and the capacity plan
    on `nodes` pods of `pool`; the plan (Markdown) is written to `capacity_out` first. Raises one
    UserError listing every problem; returns the success line."""
    from chunkgrpo.errors import UserError
    from chunkgrpo.model_cache import used_reward_weights
    from chunkgrpo.preflight import PreflightSpec, capacity_check, evaluation_inputs, require
    from chunkgrpo.preflight_image import training_problems
    from chunkgrpo.recipes import preset_for
    from chunkgrpo.stages.train import length_overrides, reward_servers, served_rewards

    if chunks:  # the plan step's own parser: a bad spec fails here, before profiling
        from chunkgrpo.chunks import parse_chunks

        try:
            parse_chunks(chunks)
        except UserError as e:
            raise UserError(f"preflight: chunks={chunks!r}: {e}") from None
    preset = preset_for(method, preset)
    benchmarks, scorers = evaluation_inputs(eval_preset, list(eval_benchmarks), list(eval_overrides),
                                            dict(scorer_weights))
    servers = reward_servers(preset, list(train_overrides), reward_url)
    served = {name for name, _ in servers}  # a server holds its reward's weights
    rewards = used_reward_weights(preset, list(train_overrides), dict(reward_weights))
    weights = {**{f"reward {k}": v for k, v in rewards.items() if k.split(".processor")[0] not in served},
               **scorers}
    # the runtime image (this task's) builds every reward not on a server: packages, venvs, cached files
    in_image = training_problems(preset, list(train_overrides), dict(reward_weights), served=served)
    spec = PreflightSpec(model=model, prompts=prompts, weights=weights, benchmarks=benchmarks,
                         artifact_root=artifact_root, reward_servers=servers, image_problems=in_image)
    require(spec)
    overrides = [*train_overrides, *served_rewards(preset, list(train_overrides), reward_url)[1],
                 *length_overrides(max_iterations)]
    report, problems = capacity_check(preset, overrides, model, pool, method, nodes)  # model is there
    Path(capacity_out).write_text(report)
    if problems:
        raise UserError(f"preflight: {len(problems)} problem(s): " + "; ".join(problems))
    return (f"preflight ok: model {model}, prompts {prompts}, {len(spec.weights)} weight URI(s), "
            f"{len(servers)} reward server(s), benchmarks {benchmarks}")


def benchmark_preflight(*, model_name: str, alias: str, base_model: str, eval_preset: str,
                        eval_benchmarks: list, eval_overrides: list, scorer_weights: dict,
                        artifact_root: str) -> str:
    """The nightly benchmark's preflight: the registry version, its base model, scorer weights, S3,
    MLflow, judge key. Raises one UserError listing every problem; returns the success line."""
    from chunkgrpo.preflight import PreflightSpec, evaluation_inputs, require

    benchmarks, weights = evaluation_inputs(eval_preset, list(eval_benchmarks), list(eval_overrides),
                                            dict(scorer_weights))
    spec = PreflightSpec(model=base_model, registered=f"{model_name}@{alias}", weights=weights,
                         benchmarks=benchmarks, artifact_root=artifact_root)
    require(spec)
    return f"preflight ok: {model_name}@{alias}, {len(spec.weights)} weight URI(s), benchmarks {benchmarks}"


def eval_image_preflight(*, eval_preset: str, eval_benchmarks: list, eval_overrides: list,
                         scorer_weights: dict, preset: str = "", method: str = "",
                         train_overrides: list = ()) -> str:
    """Run in the evaluation image: every HPDv2 scorer of the evaluation preset (+ benchmarks, overrides)
    has its package (in its venv or here) and the files it loads by name, and a LoRA model can be loaded
    (peft). The trained model is LoRA when the training preset (`preset`, else `method`'s, + overrides)
    says so; with neither (a benchmark of a registry version, which may be either) peft is required.
    Raises one UserError listing every problem; returns the success line."""
    from chunkgrpo.preflight_image import EVAL, evaluation_problems, is_lora, require
    from chunkgrpo.recipes import preset_for

    lora = is_lora(preset_for(method or "chunk", preset), list(train_overrides)) if preset or method else True
    problems = evaluation_problems(eval_preset, list(eval_benchmarks), list(eval_overrides),
                                   dict(scorer_weights), lora=lora)
    require(problems, "eval-image preflight")
    return (f"eval-image preflight ok: {EVAL} builds the scorers of {eval_preset}"
            + (" and loads LoRA adapters (peft)" if lora else ""))
