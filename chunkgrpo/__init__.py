"""chunkgrpo: Chunk-GRPO and step-level GRPO for flow-matching text-to-image models.

The library never imports kfp; `components/` and `pipeline/` adapt it to Kubeflow Pipelines.
Importing it sets the OpenMP thread policy (`chunkgrpo.threads`): this must happen before torch loads.
"""

from chunkgrpo import threads as _threads

_threads.set_env_policy()

__version__ = "0.1.0"
