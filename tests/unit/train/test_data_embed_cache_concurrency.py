"""Two trainings sharing one `embed_cache_dir`: two processes writing and reading the same cache files at
once never fail (no "file not found" from a temp file the other renamed away) and never read a partial or
mixed file — every file they read verifies."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

_WORKER = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from chunkgrpo.flux import PromptEmbeds
    from chunkgrpo.train.data import EmbeddingCache

    folder, seed, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    cache = EmbeddingCache.__new__(EmbeddingCache)  # the on-disk half only: no text encoders needed
    cache.msl, cache.dir, cache.mem, cache.rebuilt = 16, folder, {}, []
    g = torch.Generator().manual_seed(seed)
    prompts = [f"prompt {i}" for i in range(4)]
    one = lambda: PromptEmbeds(torch.randn(1, 16, 64, generator=g), torch.randn(1, 32, generator=g),
                               torch.zeros(16, 3))
    for _ in range(rounds):
        for p in prompts:
            cache._write(p, one())        # both processes publish the same files over and over
            cache._read(p)                # raises on a partial, mixed or vanished file
    print("ok")
""")


def test_two_processes_sharing_one_cache_never_see_partial_files(tmp_path):
    folder = tmp_path / "embeds" / "rank0" / "identity"
    folder.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(folder), str(seed), "150"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in (1, 2)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0 and out.strip() == "ok", err[-2000:]
    assert sorted(f.name for f in folder.iterdir() if f.name.endswith(".tmp")) == []  # no temp left behind
    assert len(list(folder.glob("*.pt"))) == 4
