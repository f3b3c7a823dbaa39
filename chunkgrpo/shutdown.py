"""Process exit without the interpreter's repeated final garbage collections.

    from chunkgrpo import shutdown
    shutdown.fast_exit()       # once, early in an entry point (the CLI, every kfp task)

At exit CPython tears its modules down and runs its cyclic garbage collector several times over every
object still alive. A process that imported torch, diffusers, transformers, peft and mlflow holds
millions of objects, and exiting took 1.56 s (0.49 s with this handler; median of 3 on 2 idle cores,
`benchmarks/process_exit.py`): every kfp.local task, torchrun worker and CLI subprocess paid it after
its work was done, about ten times per local pipeline run and hundreds of times per test session.

`fast_exit` registers an atexit handler. Handlers run last-registered first, so registered early it
runs after the ones registered later (mlflow's flush of its async logging, `logging.shutdown`, ...).
It collects garbage once, so finalizers of objects in reference cycles still run (a file object in a
cycle is still flushed), then `gc.freeze()`s the survivors: the teardown's collections skip frozen
objects, whose memory the operating system takes back with the process anyway. What changes is only
when cyclic garbage created during the module teardown itself is finalized: never, as for any object
alive at `os._exit`.
"""

from __future__ import annotations

import atexit
import gc

_registered = False


def _collect_then_freeze() -> None:
    gc.collect()
    gc.freeze()


def fast_exit() -> bool:
    """Register the exit handler (once per process); returns whether this call registered it."""
    global _registered
    if _registered:
        return False
    atexit.register(_collect_then_freeze)
    _registered = True
    return True
