"""MLflow "model from code" entry point of every registered chunkgrpo version (copied into the MLflow
Model by `chunkgrpo.registry.payload.save_pyfunc`; see chunkgrpo/served_model.py). Importing it registers the
model object with MLflow; it is not imported anywhere else."""

import mlflow

from chunkgrpo.served_model import FluxPyfunc

mlflow.models.set_model(FluxPyfunc())
