"""A tiny random-weight CLIP (transformers `CLIPModel` + a locally built `CLIPTokenizer`) for tests and
CPU benchmarks: loadable by `chunkgrpo.scoring.scorers.get_scorer("clip" | "pickscore", weights=folder)`
and by GenEval's colour classifier. Nothing is downloaded."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from chunkgrpo.testing.bpe import bytes_to_unicode

# OpenAI CLIP's normalisation, the values `chunkgrpo.scoring.backends` uses (not imported from there:
# testing/ sits below scoring/ in the layers)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def build_clip_bpe(words: Sequence[str] = ("a", "photo", "of", "the", "cat", "dog", "red", "blue"),
                   ) -> tuple[dict, list]:
    """A small byte-level CLIP BPE: 256 byte chars + their `</w>` forms + merges spelling `words` whole."""
    chars = list(bytes_to_unicode().values())
    vocab_list = chars + [c + "</w>" for c in chars]
    merges: list[str] = []
    for word in words:
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        while len(parts) > 1:
            a, b = parts[0], parts[1]
            merged = a + b
            if f"{a} {b}" not in merges:
                merges.append(f"{a} {b}")
            if merged not in vocab_list:
                vocab_list.append(merged)
            parts = [merged] + parts[2:]
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(vocab_list)}, merges


def make_tiny_clip(folder: str | os.PathLike, *, seed: int = 0, image_size: int = 32, hidden: int = 32,
                   projection_dim: int = 16, logit_scale: float = 4.6052) -> Path:
    """Save a random-weight tiny `CLIPModel` + a locally built `CLIPTokenizer` + `preprocessor_config.json`
    to `folder` (offline; ~1 MB). Loadable by `get_scorer("clip"|"pickscore", weights=folder)`."""
    import torch
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = build_clip_bpe()
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    tok = CLIPTokenizer(
        vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"), model_max_length=77
    )
    tok.save_pretrained(str(folder))
    eos = vocab["<|endoftext|>"]
    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=77,
                         bos_token_id=vocab["<|startoftext|>"], eos_token_id=eos, pad_token_id=eos),
        vision_config=dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                           num_attention_heads=4, image_size=image_size, patch_size=8),
        projection_dim=projection_dim, logit_scale_init_value=logit_scale,
    )
    CLIPModel(config).save_pretrained(str(folder))
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "CLIPImageProcessor",
                "do_resize": True,
                "size": {"shortest_edge": image_size},
                "do_center_crop": True,
                "crop_size": {"height": image_size, "width": image_size},
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": list(OPENAI_CLIP_MEAN),
                "image_std": list(OPENAI_CLIP_STD),
                "resample": 3,
                "do_convert_rgb": True,
            },
            indent=2,
        )
    )
    return folder
