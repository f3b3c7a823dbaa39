"""Capacity plan of a training run before any GPU time (`chunkgrpo capacity`, the preflight step):
`arch` (the model's components on the meta device: exact parameter counts, simulated activation peaks),
`pool` (one training pod of a GPU pool, from the training runtime) and `plan` (per-rank GPU memory, host
memory and bytes per volume of a recipe on a pool; its table and Markdown).

    from chunkgrpo.capacity.plan import capacity_plan, render_table
    from chunkgrpo.capacity.pool import load_pool
"""
