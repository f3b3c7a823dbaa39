"""chunkgrpo: Chunk-GRPO and step-level GRPO for flow-matching text-to-image models.

The library never imports kfp; `components/` and `pipeline/` adapt it to Kubeflow Pipelines.
"""

__version__ = "0.1.0"
