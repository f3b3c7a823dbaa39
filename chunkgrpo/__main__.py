"""`python -m chunkgrpo`: the command line (`chunkgrpo.cli`)."""

import sys

from chunkgrpo import threads

threads.set_env_policy()  # the OpenMP wait policy before any import loads torch (libgomp reads it once)

from chunkgrpo.cli import main  # noqa: E402 - after the thread policy

sys.exit(main())
