"""CLI subcommands, discovered automatically by `chunkgrpo.cli` (one module per command)."""
