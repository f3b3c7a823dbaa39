"""Training data: a deterministic prompt stream and a prompt-embedding cache.

The prompt order is a pure function of (seed, iteration), so a resumed run sees exactly the prompts
an uninterrupted run would; no sampler state needs saving beyond the iteration number.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch

from chunkgrpo.flux import PromptEmbeds

log = logging.getLogger(__name__)


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


ENCODER_PARTS = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
_FULL_HASH_BYTES = 64 << 20  # files up to this size are hashed whole (configs, tokenizers, tiny encoders)
_SAMPLE_BYTES = 1 << 20
_MAGIC = b"chunkgrpo.embeds/v1\n"


def _file_fingerprint(path: Path, recorded: dict | None) -> str:
    """sha256 of a file: the model folder's MANIFEST.json entry when it has one of the right size
    (models pulled from S3 are verified against it), else computed — whole up to 64 MiB; for larger
    weight files (T5-XXL: ~9.5 GB) size + the first, middle and last MiB (the safetensors header, which
    holds every tensor's name, dtype, shape and offset, is in the first)."""
    size = path.stat().st_size
    if recorded and int(recorded.get("size", -1)) == size and recorded.get("sha256"):
        return recorded["sha256"]
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= _FULL_HASH_BYTES:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            for off in (0, size // 2, size - _SAMPLE_BYTES):
                f.seek(off)
                h.update(f.read(_SAMPLE_BYTES))
    return "sampled:" + h.hexdigest()


def encoder_identity(model_path: str | Path, max_sequence_length: int, dtype) -> str:
    """The identity of what turns a prompt into embeddings: every file of the text encoders and
    tokenizers (see `_file_fingerprint`), max_sequence_length and the dtype they run in. A cache entry
    is only ever read under the identity it was written with."""
    import json

    root = Path(model_path)
    recorded: dict = {}
    if (root / "MANIFEST.json").is_file():
        try:
            recorded = json.loads((root / "MANIFEST.json").read_text(encoding="utf-8")).get("files") or {}
        except (OSError, ValueError, AttributeError):
            recorded = {}
    h = hashlib.sha256(f"msl={max_sequence_length}\x00dtype={dtype}".encode())
    for part in ENCODER_PARTS:
        folder = root / part
        files = sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
        h.update(f"\x00{part}:{len(files)}".encode())
        for f in files:
            rel = f.relative_to(root).as_posix()
            h.update(f"\x00{rel}={_file_fingerprint(f, recorded.get(rel))}".encode())
    return h.hexdigest()[:24]


class CorruptEmbeddingError(Exception):
    """A cache file that fails its checksum or does not hold the embedding it is named for."""


class EmbeddingCache:
    """Prompt → PromptEmbeds, computed once with the text encoders; kept in memory and on disk.

    On disk: `cache_dir/<encoder identity>/<sha256(prompt)>.pt`, the identity from `encoder_identity`
    (another base model, encoder, tokenizer, max_sequence_length or dtype is another folder: never
    reused). Each file is `magic, sha256(payload), payload` written atomically (own temp name, fsync, rename;
    trainings sharing the folder never see each other's partial files); a read
    checks the checksum, the prompt stored inside, the shapes and finiteness — a file that fails any
    check (truncated, bit-flipped, planted) is re-encoded and replaced, with one warning."""

    def __init__(self, model, cache_dir: str | Path, max_sequence_length: int):
        self.model, self.msl = model, max_sequence_length
        self.identity = encoder_identity(getattr(model, "path", "") or "", max_sequence_length, model.dtype)
        self.dir = Path(cache_dir) / self.identity
        self.mem: dict[str, PromptEmbeds] = {}
        self.rebuilt: list[str] = []
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, prompt: str) -> Path:
        h = hashlib.sha256(f"{self.msl}\x00{prompt}".encode()).hexdigest()[:32]
        return self.dir / f"{h}.pt"

    def _write(self, prompt: str, one: PromptEmbeds) -> None:
        import io

        buf = io.BytesIO()
        torch.save({"prompt": prompt, "prompt_embeds": one.prompt_embeds.cpu(), "pooled": one.pooled.cpu(),
                    "text_ids": one.text_ids.cpu()}, buf)
        payload = buf.getvalue()
        path = self._path(prompt)
        # published atomically under concurrency (trainings sharing `embed_cache_dir`): a temp name of this
        # writer's own in the same folder, fsynced, then os.replace — a reader sees a whole file or none,
        # and two writers of one prompt never write into, or rename away, each other's temp file
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=self.dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _read(self, prompt: str) -> PromptEmbeds:
        """The verified embedding of `prompt` from disk; CorruptEmbeddingError if the file fails a check."""
        import io

        path = self._path(prompt)
        raw = path.read_bytes()
        head = len(_MAGIC) + 65
        if not raw.startswith(_MAGIC) or len(raw) < head:
            raise CorruptEmbeddingError(f"{path.name}: not a cache file of this version ({len(raw)} bytes)")
        digest, payload = raw[len(_MAGIC):head - 1].decode("ascii", "replace"), raw[head:]
        if hashlib.sha256(payload).hexdigest() != digest:
            raise CorruptEmbeddingError(f"{path.name}: sha256 differs from the one recorded "
                                        f"({len(raw)} bytes)")
        try:
            d = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
            emb = PromptEmbeds(d["prompt_embeds"], d["pooled"], d["text_ids"])
            pe = emb.prompt_embeds
            ok = (d.get("prompt") == prompt and pe.ndim == 3 and pe.shape[0] == 1 and pe.shape[1] == self.msl
                  and emb.pooled.shape[0] == 1 and bool(torch.isfinite(pe).all())
                  and bool(torch.isfinite(emb.pooled).all()))
        except Exception as e:
            raise CorruptEmbeddingError(f"{path.name}: unreadable ({type(e).__name__})") from None
        if not ok:
            raise CorruptEmbeddingError(f"{path.name}: does not hold a finite embedding of this prompt")
        return emb

    def _valid(self, prompt: str) -> bool:
        """Loaded into memory if its file verifies; a failing file is removed (it is rebuilt)."""
        path = self._path(prompt)
        if not path.exists():
            return False
        try:
            self.mem[prompt] = self._read(prompt).to(self.model.device, self.model.dtype)
            return True
        except (CorruptEmbeddingError, OSError) as e:
            log.warning("prompt-embedding cache: %s; re-encoding it", e)
            self.rebuilt.append(prompt)
            path.unlink(missing_ok=True)
            return False

    def precompute(self, prompts: list[str], batch_size: int = 8) -> int:
        """Encode every prompt not cached yet (or whose cache file fails verification); returns how many
        were encoded."""
        todo = [p for p in dict.fromkeys(prompts) if p not in self.mem and not self._valid(p)]
        for i in range(0, len(todo), batch_size):
            chunk = todo[i:i + batch_size]
            emb = self.model.encode_prompts(chunk, self.msl)
            for j, p in enumerate(chunk):
                one = emb.index(slice(j, j + 1))
                self._write(p, one)
                self.mem[p] = one.to(self.model.device, self.model.dtype)
        return len(todo)

    def get(self, prompts: list[str]) -> PromptEmbeds:
        missing = [p for p in prompts if p not in self.mem]
        if missing:
            self.precompute(missing)
        return PromptEmbeds.cat([self.mem[p] for p in prompts])
