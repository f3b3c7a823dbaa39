"""Process start without most of the interpreter's full garbage collections.

    from chunkgrpo import startup
    startup.fewer_full_collections()   # first thing in an entry point (the CLI, every kfp task, torchrun)

A process of this project starts by importing torch, diffusers, transformers, peft and mlflow: about a
million objects that live as long as it does. CPython (3.11) runs a full collection of its cyclic garbage
collector whenever ten second-generation collections have passed and the objects that survived them have
grown by a quarter since the last one, so such an import runs about eight full collections, each walking
every object loaded so far. That is ~0.9 CPU-s of a training rank's ~6 s start and ~0.4 CPU-s of a task
that imports only mlflow (`python benchmarks/startup_gc.py` measures both policies), paid by every torchrun
rank, kfp task and CLI process.

`fewer_full_collections` raises the third threshold from CPython's 10 to `FULL_AFTER` second-generation
collections. The young generations keep their thresholds, so short-lived reference cycles are collected as
often as before; full collections still run, on roughly a hundred times as many allocations, and only when
the quarter rule also holds. What waits longer is cyclic garbage among long-lived objects.
`CHUNKGRPO_GC=default` keeps CPython's thresholds (for before/after measurements).

Importing `chunkgrpo` changes nothing: a program that imports the library keeps its own collector settings.
The exit has its own policy (`chunkgrpo.shutdown`).
"""

from __future__ import annotations

import gc
import os

ENV = "CHUNKGRPO_GC"
FULL_AFTER = 1000  # second-generation collections between full ones (CPython: 10)


def fewer_full_collections() -> bool:
    """Apply the policy to this process (idempotent); False when `$CHUNKGRPO_GC` is `default`.
    ValueError (one line, naming the value) for any other value."""
    value = os.environ.get(ENV, "").strip()
    if value not in ("", "default"):
        raise ValueError(f"{ENV}={value!r}: leave it unset, or 'default' for CPython's collector thresholds")
    if value == "default":
        return False
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_AFTER)
    return True
