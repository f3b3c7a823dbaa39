"""What the warm task launcher's server imports once (`pipeline/warm.py`); never imported elsewhere.

Importing this module imports the libraries every kfp.local task of chunkgrpo pays for at start-up
(torch with the part of it diffusers loads, mlflow, kfp's executor, the S3 client, numpy, PIL), and
records every environment variable they read while doing so (`warm.record_imports`): `IMPORT_ENV`,
name -> value at its first read (None = unset), and `ITERATED`, the modules that went through the whole
environment (`warm.ITERATORS` says what each known one keeps). A task forked from the server sees these
libraries as they were imported under that environment, so the launcher forks a task only when its own
environment has the same values there (and under `warm.NATIVE_PREFIXES`, which native code reads with
getenv, unseen here); otherwise the task starts in a fresh interpreter.

The hub and config libraries (huggingface_hub, transformers, diffusers, matplotlib) fix $HF_HOME,
$XDG_CACHE_HOME, $MPLCONFIGDIR when imported, and those differ between tasks (the pod volumes): the
recording sees those reads, so a task with other values gets a server of its own. Nothing here may run a
torch operator: a forked child of a process whose OpenMP thread team exists hangs in its first parallel
region.
"""

from pipeline.warm import record_imports

MODULES = (
    "chunkgrpo",  # first: the thread policy's OpenMP environment, before torch loads libgomp
    "torch",
    "numpy",
    "PIL.Image",
    "minio",
    "mlflow",
    "kfp.dsl.executor",
    "matplotlib.pyplot",
    # what the components import (components/*/component.py), with diffusers, transformers and peft
    "chunkgrpo.store.client",
    "chunkgrpo.store.manifest",
    "chunkgrpo.tracking",
    "chunkgrpo.recipes",
    "chunkgrpo.model_cache",
    "chunkgrpo.preflight",
    "chunkgrpo.capacity.plan",
    "chunkgrpo.capacity.arch",
    "chunkgrpo.dynamics",
    "chunkgrpo.chunks",
    "chunkgrpo.flux",
    "chunkgrpo.train.config",
    "chunkgrpo.torchrun",
    "chunkgrpo.torchrun_local",
    "chunkgrpo.eval.config",
    "chunkgrpo.eval.runner",
    "chunkgrpo.eval.base_cache",
    "chunkgrpo.registry.gate",
    "chunkgrpo.registry.promotion",
    "chunkgrpo.registry.registration",
    "chunkgrpo.registry.load",
    "diffusers.models.transformers",  # every transformer class: `from diffusers import X` loads them all
    "diffusers.models.autoencoders",
    "transformers.models.clip.modeling_clip",
    "transformers.models.t5.modeling_t5",
    "peft",
)


IMPORT_ENV, ITERATED = record_imports(MODULES)
