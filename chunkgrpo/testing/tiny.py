"""Tiny FLUX factory: a diffusers-format FLUX pipeline folder with the real classes
(FluxTransformer2DModel, AutoencoderKL, CLIPTextModel, T5EncoderModel, FlowMatchEulerDiscreteScheduler)
and random weights, tokenizers built locally. `FluxPipeline.from_pretrained(DIR)` loads it with
HF_HUB_OFFLINE=1; the project's loader (`chunkgrpo.flux.load_flux`) loads it and a real FLUX.1-dev
folder through the same code.

Sizes: `tiny` (~0.2 M parameters, 64×64 images in milliseconds) for tests and the demo; `mid`
(a few tens of M parameters) for CPU benchmarks; `flux` = the FLUX.1-dev transformer architecture
(random weights, ~12 B parameters; GPU benchmarks only).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from chunkgrpo.errors import UserError
from chunkgrpo.testing.bpe import bytes_to_unicode

# A small, fixed corpus so the tokenizers cover ordinary prompt words deterministically.
_CORPUS = [
    "a photo of a cat sitting on a red chair", "a dog running in the park at sunset",
    "a bowl of fruit on a wooden table", "an astronaut riding a horse on the moon",
    "a painting of a mountain lake in autumn", "two blue birds on a green branch",
    "a city street at night with neon lights", "a cup of coffee next to a laptop",
    "a portrait of an old man with a white beard", "a yellow car parked by the sea",
    "three apples and an orange", "a black and white photo of a bridge", "a cute robot toy",
    "a bright colorful abstract pattern", "a dark forest with fog", "a pink flower in a vase",
]

SIZES = {
    "tiny": dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                 text_dim=32, clip_dim=32, vae_channels=(8, 16, 16, 16), guidance_embeds=False,
                 axes_dims_rope=(4, 4, 8)),
    "mid": dict(num_layers=2, num_single_layers=4, attention_head_dim=64, num_attention_heads=8,
                text_dim=256, clip_dim=128, vae_channels=(32, 64, 64, 64), guidance_embeds=True,
                axes_dims_rope=(16, 24, 24)),
    "flux": dict(num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
                 text_dim=4096, clip_dim=768, vae_channels=(128, 256, 512, 512), guidance_embeds=True,
                 axes_dims_rope=(16, 56, 56)),
}


def build_clip_tokenizer(out_dir: Path, corpus: list[str] = _CORPUS, max_merges: int = 200):
    """A byte-level BPE CLIPTokenizer learned from `corpus` (simple greedy pair merges)."""
    from transformers import CLIPTokenizer

    chars = list(bytes_to_unicode().values())
    vocab_list = chars + [c + "</w>" for c in chars]
    words = [list(w[:-1]) + [w[-1] + "</w>"] for line in corpus for w in line.lower().split()]
    merges: list[tuple[str, str]] = []
    for _ in range(max_merges):
        counts: dict[tuple[str, str], int] = {}
        for w in words:
            for a, b in zip(w, w[1:]):
                counts[(a, b)] = counts.get((a, b), 0) + 1
        if not counts:
            break
        pair = max(sorted(counts), key=lambda p: counts[p])
        if counts[pair] < 2:
            break
        merges.append(pair)
        merged = pair[0] + pair[1]
        vocab_list.append(merged)
        new_words = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == pair:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words.append(out)
        words = new_words
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(vocab_list))}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps(vocab))
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in merges) + "\n")
    tok = CLIPTokenizer(
        vocab=str(out_dir / "vocab.json"), merges=str(out_dir / "merges.txt"), model_max_length=77
    )
    return tok


def build_t5_tokenizer(corpus: list[str] = _CORPUS, vocab_size: int = 150):
    """A Unigram T5 tokenizer trained locally with `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import T5TokenizerFast

    uni = Tokenizer(models.Unigram())
    uni.normalizer = normalizers.NFKC()
    uni.pre_tokenizer = pre_tokenizers.Metaspace()
    uni.decoder = decoders.Metaspace()
    uni.train_from_iterator(corpus, trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>"))
    vocab = [tuple(x) for x in json.loads(uni.to_str())["model"]["vocab"]]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=512)


MARKER = "chunkgrpo_tiny.json"  # written into every folder this module makes


def _check_target(out: Path, overwrite: bool) -> None:
    """Refuse to write over anything this command did not make: a file, a non-empty folder (unless
    `overwrite` and the folder is an earlier tiny model, recognised by its marker file)."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError(f"--out {out} exists and is not a directory; choose a folder path")
    if not out.exists() or not any(out.iterdir()):
        return
    if not overwrite:
        raise UserError(f"--out {out} is a non-empty directory; refusing to replace it "
                        "(pass --overwrite to replace an earlier tiny model, or choose another path)")
    if not (out / MARKER).is_file():
        raise UserError(
            f"--out {out} is a non-empty directory not made by `chunkgrpo tiny-model` (no {MARKER}); "
            "refusing to delete it even with --overwrite"
        )
    foreign = _foreign_files(out)
    if foreign:
        raise UserError(f"--out {out} is an earlier tiny model but holds {len(foreign)} file(s) "
                        f"`chunkgrpo tiny-model` did not write or that changed since (e.g. {foreign[0]}); "
                        "refusing to delete them even with --overwrite")


_TINY_PARTS = {"model_index.json", MARKER, "scheduler", "text_encoder", "text_encoder_2", "tokenizer",
               "tokenizer_2", "transformer", "vae"}


def _file_list(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `folder` except the marker."""
    import hashlib

    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if (p.is_file() or p.is_symlink()) and p.name != MARKER}


def _foreign_files(out: Path) -> list[str]:
    """Files in an earlier tiny-model folder that its marker does not record (added, or changed since);
    markers written before the file list was recorded: anything outside the pipeline's own parts."""
    try:
        recorded = json.loads((out / MARKER).read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):
        recorded = None
    present = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() or p.is_symlink()}
    present.discard(MARKER)
    if not isinstance(recorded, dict):
        return sorted(p for p in present if p.split("/")[0] not in _TINY_PARTS)
    now = _file_list(out)
    return sorted(p for p in present if recorded.get(p) != now.get(p))


def build_tiny_flux(
    out_dir: str | Path, *, seed: int = 0, size: str = "tiny", overwrite: bool = True,
    layers: tuple[int, int] | None = None,
) -> Path:
    """Write a diffusers FLUX pipeline folder with random weights. Returns the folder.

    `layers` = (double-stream, single-stream) blocks of the transformer instead of the size's own (the
    GPU benchmark writes a one-block FLUX-width folder and builds the 57-block transformer on the GPU).

    An existing non-empty `out_dir` is replaced only if `overwrite` and it is an earlier tiny model
    (has the marker file); anything else is refused, so a run folder is never deleted by mistake.
    """
    if size not in SIZES:
        raise UserError(f"unknown tiny-model size {size!r} (choose one of {sorted(SIZES)})")
    if not 0 <= seed < 2**32:  # the range torch.manual_seed accepts on every device, and train's seed range
        raise UserError(f"seed={seed} must be in 0..{2**32 - 1}")
    out = Path(out_dir)
    _check_target(out, overwrite)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    cfg = dict(SIZES[size])
    if layers is not None:
        if len(layers) != 2 or min(layers) < 1:
            raise UserError(f"layers must be two block counts >= 1, got {layers!r}")
        cfg["num_layers"], cfg["num_single_layers"] = layers
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_clip_tokenizer(Path(tmp))
        tokenizer_2 = build_t5_tokenizer()
        text_encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=cfg["clip_dim"], intermediate_size=2 * cfg["clip_dim"],
            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=77,
            projection_dim=cfg["clip_dim"], bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_2), d_model=cfg["text_dim"], d_kv=8, d_ff=2 * cfg["text_dim"],
            num_layers=2, num_heads=4, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=16,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=cfg["vae_channels"], layers_per_block=1, norm_num_groups=4, sample_size=64,
            use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611)
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=cfg["num_layers"],
            num_single_layers=cfg["num_single_layers"],
            attention_head_dim=cfg["attention_head_dim"],
            num_attention_heads=cfg["num_attention_heads"],
            joint_attention_dim=cfg["text_dim"],
            pooled_projection_dim=cfg["clip_dim"],
            guidance_embeds=cfg["guidance_embeds"],
            axes_dims_rope=list(cfg["axes_dims_rope"]),
        )
        pipe = FluxPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer_2,
            transformer=transformer,
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        # staged under a fresh unique name next to the target: only folders made here are ever removed
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
        try:
            pipe.save_pretrained(staging)
            marker = {"size": size, "seed": seed, "files": _file_list(staging),
                      **({"layers": list(layers)} if layers else {})}
            (staging / MARKER).write_text(json.dumps(marker))
            _check_target(out, overwrite)  # again: something may have appeared meanwhile
            if out.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
                out.rename(old / "model")  # an empty dir or an earlier tiny model (checked above)
                staging.rename(out)
                shutil.rmtree(old)
            else:
                staging.rename(out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return out
