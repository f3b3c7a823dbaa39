"""Training data: a deterministic prompt stream and a prompt-embedding cache.

The prompt order is a pure function of (seed, iteration), so a resumed run sees exactly the prompts
an uninterrupted run would; no sampler state needs saving beyond the iteration number.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from chunkgrpo.flux import PromptEmbeds


class PromptStream:
    """Iteration i, rank r → the r-th slice of the i-th global batch of a seeded epoch permutation."""

    def __init__(self, prompts: list[str], per_rank: int, world: int, seed: int):
        self.prompts, self.per_rank, self.world, self.seed = prompts, per_rank, world, seed
        self.global_batch = per_rank * world

    def _perm(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.prompts), generator=g).tolist()

    def batch(self, iteration: int, rank: int) -> list[str]:
        start = iteration * self.global_batch + rank * self.per_rank
        out = []
        for pos in range(start, start + self.per_rank):
            epoch, i = divmod(pos, len(self.prompts))
            out.append(self.prompts[self._perm(epoch)[i]])
        return out

    def all_for(self, rank: int, iterations: range) -> list[str]:
        return list(dict.fromkeys(p for it in iterations for p in self.batch(it, rank)))


class EmbeddingCache:
    """Prompt → PromptEmbeds, computed once with the text encoders; kept in memory and on disk."""

    def __init__(self, model, cache_dir: str | Path, max_sequence_length: int):
        self.model, self.dir, self.msl = model, Path(cache_dir), max_sequence_length
        self.mem: dict[str, PromptEmbeds] = {}
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, prompt: str) -> Path:
        h = hashlib.sha256(f"{self.msl}\x00{prompt}".encode()).hexdigest()[:32]
        return self.dir / f"{h}.pt"

    def precompute(self, prompts: list[str], batch_size: int = 8) -> int:
        """Encode every prompt not cached yet; returns how many were encoded."""
        todo = [p for p in dict.fromkeys(prompts) if p not in self.mem and not self._path(p).exists()]
        for i in range(0, len(todo), batch_size):
            chunk = todo[i:i + batch_size]
            emb = self.model.encode_prompts(chunk, self.msl)
            for j, p in enumerate(chunk):
                one = emb.index(slice(j, j + 1))
                tmp = self._path(p).with_suffix(".tmp")
                torch.save({"prompt_embeds": one.prompt_embeds.cpu(), "pooled": one.pooled.cpu(),
                            "text_ids": one.text_ids.cpu()}, tmp)
                tmp.replace(self._path(p))
        return len(todo)

    def get(self, prompts: list[str]) -> PromptEmbeds:
        items = []
        for p in prompts:
            if p not in self.mem:
                path = self._path(p)
                if not path.exists():
                    self.precompute([p])
                d = torch.load(path, map_location="cpu", weights_only=True)
                self.mem[p] = PromptEmbeds(d["prompt_embeds"], d["pooled"], d["text_ids"]).to(
                    self.model.device, self.model.dtype)
            items.append(self.mem[p])
        return PromptEmbeds.cat(items)
