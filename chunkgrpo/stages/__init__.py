"""The pipeline's steps as plain functions: typed inputs in, a small dataclass out, no kfp.

One module per step (or pair of steps): `preflight`, `profile`, `plan`, `train` (single node, torchrun in
the task; also the CLI's `chunkgrpo train` and its dry run), `launch` (multi-node TrainJob / PyTorchJob),
`evaluate`, `regression` (the nightly check), `register`, `promote` (gate + promotion), `tracking` (the
pipeline run's MLflow parent run), `models` (the S3 model cache), `ablation` (the nightly toy ablation);
`task` holds the process setup and output locations every pipeline task shares.

Each KFP component (`components/<step>/component.py`) is a thin adapter: it converts its Input/Output
artifacts to paths and plain values, calls its stage, and writes the stage's result into its outputs.
The CLI commands (`chunkgrpo.commands`) call the same functions, so each step has one implementation.
The modules import their heavy dependencies inside the functions: the launcher image has no torch, and
tests replace library functions (store, registry, runner) where they are defined.
"""
