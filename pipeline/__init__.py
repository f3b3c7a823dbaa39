"""Kubeflow pipelines of chunkgrpo and the `chunkgrpo pipeline` command.

    pipeline/train_and_evaluate.py   profile -> plan -> train -> evaluate -> register -> gate -> promote
    pipeline/nightly_benchmark.py    evaluate champion vs base on the benchmark suites, flag regressions
    pipeline/compile.py              compile (+ Literal dropdowns in the IR), parameter overrides
    pipeline/local_run.py            `chunkgrpo pipeline run --local`: kfp.local against local S3 + MLflow
                                     (demos.py: its inputs; kfp_tasks.py, task_log.py, summary.py;
                                     pod_faithful.py: `--pod-faithful`)
    pipeline/cli.py                  `chunkgrpo pipeline compile|upload|run|schedule`

Nothing here is imported by `chunkgrpo/` (the library never imports kfp).
"""
