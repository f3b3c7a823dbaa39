import sys

from chunkgrpo.cli import main

sys.exit(main())
