"""`torchrun --nproc_per_node=N -m chunkgrpo.train --config PRESET [key=value ...]`"""

import sys

from chunkgrpo import threads

threads.set_env_policy()  # the OpenMP wait policy before any import loads torch (libgomp reads it once)

from chunkgrpo.cli import main  # noqa: E402 - after the thread policy

sys.exit(main(["train", *sys.argv[1:]]))
