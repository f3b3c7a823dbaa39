"""`torchrun --nproc_per_node=N -m chunkgrpo.train --config PRESET [key=value ...]`"""

import sys

from chunkgrpo.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
