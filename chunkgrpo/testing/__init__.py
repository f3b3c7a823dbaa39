"""Synthetic models, tokenizers and scorers for tests and the wiring demo (never used by a production run).

Everything here builds small random-weight objects with the real architectures (FLUX transformer, T5,
CLIP, VAE, reward-model heads) so that the real loading and scoring code can be exercised without
downloading weights. Production code under ``chunkgrpo/`` must not import this package; the import-graph
test (tests/test_architecture.py) enforces that only ``commands/``, ``toy/`` and tests may.
"""
