"""chunkgrpo: Chunk-GRPO and step-level GRPO for flow-matching text-to-image models.

The library never imports kfp; `components/` and `pipeline/` adapt it to Kubeflow Pipelines.
Importing it changes nothing in the process: each entry point (the CLI, `python -m chunkgrpo`,
`python -m chunkgrpo.train` under torchrun, the components' tasks) sets the thread policy
(`chunkgrpo.threads`) itself, before torch loads.
"""

__version__ = "0.1.0"
