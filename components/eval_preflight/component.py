"""Eval-image preflight: in seconds, on the evaluation image, before training, that the image builds every
scorer the evaluation uses and can load the trained model. The steps are
`chunkgrpo.stages.preflight.eval_image_preflight`."""

from kfp import dsl

from components.images import EVAL_IMAGE


@dsl.component(base_image=EVAL_IMAGE, install_kfp_package=False)
def eval_preflight(eval_preset: str, eval_benchmarks: list, eval_overrides: list, scorer_weights: dict,
                   preset: str = "", method: str = "", train_overrides: list = []) -> str:
    """Check, in the evaluation image, each scorer's package (in its reward venv or the image's main
    environment), the files it loads by name (tokenizers, base models in the Hugging Face cache), and peft
    when the trained model is a LoRA adapter.

    Args:
        eval_preset: evaluation preset (its benchmarks are used when eval_benchmarks is empty).
        eval_benchmarks: benchmark suites of this run ([] = the preset's).
        eval_overrides: evaluation overrides (key=value).
        scorer_weights: {scorer: weights URI, '<scorer>.processor': URI} for evaluation.
        preset: training preset whose `lora` setting says whether the trained model is a LoRA adapter.
        method: training method (its own preset when `preset` is ''); preset and method both '' = a
            registry version, LoRA or not: peft is checked.
        train_overrides: training overrides (key=value), e.g. lora.enabled=false.

    Returns:
        "ok" (the step fails with one line listing every problem otherwise).
    """
    from chunkgrpo.stages.task import stage_env

    stage_env("")
    from chunkgrpo.stages.preflight import eval_image_preflight

    print(eval_image_preflight(eval_preset=eval_preset, eval_benchmarks=list(eval_benchmarks),
                               eval_overrides=list(eval_overrides), scorer_weights=dict(scorer_weights),
                               preset=preset, method=method, train_overrides=list(train_overrides)))
    return "ok"
