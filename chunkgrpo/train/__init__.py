"""The training stage: a torchrun trainer for Chunk-GRPO and step-level GRPO (and the branching
methods TempFlow-GRPO / Granular-GRPO) on FLUX. Entry: `chunkgrpo train --config PRESET [k=v ...]`
or `torchrun --nproc_per_node=N -m chunkgrpo.train --config PRESET [k=v ...]`."""
