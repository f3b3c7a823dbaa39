"""Random-weight reward models built with each package's own classes, for tests and CPU benchmarks.

    <venv>/bin/python -m chunkgrpo.testing.tiny_scorers hpsv2|imagereward|hpsv3 OUT_DIR [--seed N]

Runs inside the package's reward venv (staged next to `chunkgrpo.scoring.worker` by
`chunkgrpo.scoring.client.run_module(venv, "chunkgrpo.testing.tiny_scorers", ...)`) and imports only the
standard library, numpy, torch and the reward package with its own dependencies (transformers,
tokenizers). Nothing is downloaded: tokenizers are built here, and each model is the package's real
class built from the package's own config (reduced where the real one does not fit a CPU test) and saved
in the layout the package's loader reads:

- hpsv2 : `tiny-hpsv2.json` (an open_clip model config: the ViT-H-14 layout with 2 layers, width 64) and
          `HPS_v2.1_compressed.pt` = {"state_dict": ...} of the CLIP built by `hpsv2.src.open_clip`. The
          tokenizer is open_clip's real BPE (its vocabulary file ships with open-clip-torch).
- imagereward: `ImageReward.pt` (state_dict of `ImageReward.ImageReward`: BLIP ViT-L - the package hard-codes
          'large' - and a 2-layer BERT from a reduced `med_config.json`), and `hf_home/` = a Hugging Face
          cache holding a locally built `bert-base-uncased` WordPiece tokenizer, which the package loads by
          name (set HF_HOME to it); `reference.png` and, in the result line, the score the package's
          own model gives it with the saved weights.
- hpsv3 : `Qwen2-VL-tiny/` (a 2-layer `Qwen2VLForConditionalGeneration` + a byte-level BPE tokenizer with the
          Qwen2-VL special tokens, `Qwen2VLImageProcessor` and a chat template) and `HPSv3.safetensors` = the
          state_dict of `Qwen2VLRewardModelBT` made by hpsv3's own `create_model_and_processor`.
Prints one JSON line describing what it wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

_CORPUS = [
    "a photo of a cat sitting on a red chair", "a dog running in the park at sunset",
    "a bowl of fruit on a wooden table", "an astronaut riding a horse on the moon",
    "a painting of a mountain lake in autumn", "two blue birds on a green branch",
    "a city street at night with neon lights", "a portrait of an old man with a white beard",
    "a yellow car parked by the sea", "a black and white photo of a bridge", "a cute robot toy",
]


def _save_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


# ---- hpsv2 -------------------------------------------------------------------------------------

HPSV2_TINY = {  # ViT-H-14's config layout (open_clip), reduced
    "embed_dim": 32,
    "vision_cfg": {"image_size": 224, "layers": 2, "width": 64, "head_width": 32, "patch_size": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}


def build_hpsv2(out: Path, seed: int = 0) -> dict:
    import torch

    oc = __import__("hpsv2.src.open_clip", fromlist=["create_model_and_transforms"])
    cfg = out / "tiny-hpsv2.json"
    _save_json(cfg, HPSV2_TINY)
    oc.add_model_config(cfg)
    torch.manual_seed(seed)
    model, _, _ = oc.create_model_and_transforms(
        "tiny-hpsv2",
        None,
        precision="amp",
        device="cpu",
        jit=False,
        force_quick_gelu=False,
        force_custom_text=False,
        force_patch_dropout=False,
        force_image_size=None,
        pretrained_image=False,
        image_mean=None,
        image_std=None,
        light_augmentation=True,
        aug_cfg={},
        output_dict=True,
        with_score_predictor=False,
        with_region_predictor=False,
    )
    ckpt = out / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": model.state_dict()}, ckpt)
    return {
        "weights": str(ckpt),
        "model_config": str(cfg),
        "model_class": type(model).__module__ + "." + type(model).__qualname__,
    }


# ---- imagereward -------------------------------------------------------------------------------


def _bert_vocab() -> list[str]:
    words = sorted({w for line in _CORPUS for w in line.split()})
    chars = (
        [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)] + list(".,!?'-:;()\"")
    )
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + ["##" + c for c in chars] + words


def write_bert_cache(hf_home: Path) -> Path:
    """A Hugging Face hub cache entry for `bert-base-uncased` (refs/main -> snapshot) with a small WordPiece
    vocabulary, laid out as `huggingface_hub` stores downloads."""
    vocab = _bert_vocab()
    text = "\n".join(vocab) + "\n"
    rev = hashlib.sha1(text.encode()).hexdigest()
    repo = hf_home / "hub" / "models--bert-base-uncased"
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True, exist_ok=True)
    (snap / "vocab.txt").write_text(text)
    _save_json(snap / "tokenizer_config.json", {"do_lower_case": True, "model_max_length": 512,
                                                "tokenizer_class": "BertTokenizer"})
    _save_json(
        snap / "config.json",
        {
            "model_type": "bert",
            "vocab_size": len(vocab),
            "hidden_size": 768,
            "num_hidden_layers": 2,
            "num_attention_heads": 12,
            "intermediate_size": 256,
        },
    )
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    return snap


def build_imagereward(out: Path, seed: int = 0) -> dict:
    hf_home = out / "hf_home"
    write_bert_cache(hf_home)
    os.environ["HF_HOME"] = str(hf_home)  # before huggingface_hub is imported: it reads HF_HOME once
    os.environ["HF_HUB_OFFLINE"] = "1"
    import ImageReward as RM
    import torch

    med = out / "med_config.json"
    _save_json(
        med,
        {  # BLIP's med_config (bert-base + cross-attention), 2 layers; hidden 768 fixed by MLP(768)
            "architectures": ["BertModel"],
            "attention_probs_dropout_prob": 0.1,
            "hidden_act": "gelu",
            "hidden_dropout_prob": 0.1,
            "hidden_size": 768,
            "initializer_range": 0.02,
            "intermediate_size": 256,
            "layer_norm_eps": 1e-12,
            "max_position_embeddings": 512,
            "model_type": "bert",
            "num_attention_heads": 12,
            "num_hidden_layers": 2,
            "pad_token_id": 0,
            "type_vocab_size": 2,
            "vocab_size": len(_bert_vocab()) + 2,
            "encoder_width": 1024,
            "add_cross_attention": True,
        },
    )
    torch.manual_seed(seed)
    model = RM.ImageReward(med_config=str(med), device="cpu")
    # The package initialises its MLP head with std 1/(768+1) in every layer, which makes an untrained head
    # print the same reward for every input; a 1/sqrt(fan_in) draw keeps scores input-dependent.
    for layer in model.mlp.layers:
        if isinstance(layer, torch.nn.Linear):
            torch.nn.init.normal_(layer.weight, std=layer.in_features ** -0.5)
    ckpt = out / "ImageReward.pt"
    # float16 halves the file (ViT-L alone is 300 M parameters); load_state_dict casts back to float32
    state = {k: (v.half() if v.is_floating_point() else v) for k, v in model.state_dict().items()}
    torch.save(state, ckpt)
    # the package's own scores of the saved weights (its load: this model, load_state_dict copying into
    # float32), for a loader to be compared with (one image: a ViT-L forward is a second of CPU)
    model.load_state_dict(state)
    model.eval()
    prompt, image = "a photo of a cat", out / "reference.png"
    _gradient_image(80, 48).save(image)
    with torch.no_grad():
        score = float(model.score(prompt, str(image)))
    return {"weights": str(ckpt), "med_config": str(med), "hf_home": str(hf_home),
            "model_class": type(model).__module__ + "." + type(model).__qualname__,
            "reference": {"prompt": prompt, "image": str(image), "score": score}}


def _gradient_image(w: int, h: int):
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(0)
    arr = np.stack([x * 255 // (w - 1), y * 255 // (h - 1), rng.integers(0, 255, (h, w))], -1)
    return Image.fromarray(arr.astype(np.uint8))


# ---- hpsv3 -------------------------------------------------------------------------------------

QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's conversation format: system turn, user turn with image placeholders, assistant prefix
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_qwen2vl_base(base: Path, corpus: list[str], seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        Qwen2TokenizerFast,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
    )

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=700, special_tokens=QWEN_SPECIAL,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = Qwen2TokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                             unk_token=None, bos_token=None, model_max_length=32768,
                             additional_special_tokens=QWEN_SPECIAL[1:])
    tok.chat_template = CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 1280, patch_size=14,
                                            temporal_patch_size=2, merge_size=2)
    Qwen2VLProcessor(
        image_processor=image_processor, tokenizer=tok, chat_template=CHAT_TEMPLATE
    ).save_pretrained(base)
    config = Qwen2VLConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},  # sums to head_dim / 2 = 8
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_chans": 3,
        },
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        vision_token_id=ids["<|vision_pad|>"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
    )
    torch.manual_seed(seed)
    Qwen2VLForConditionalGeneration(config).save_pretrained(base)
    return base


def build_hpsv3(out: Path, seed: int = 0) -> dict:
    import hpsv3
    import torch
    import yaml
    from hpsv3.dataset.data_collator_qwen import INSTRUCTION, prompt_with_special_token
    from hpsv3.train import create_model_and_processor
    from hpsv3.utils.parser import (
        DataConfig,
        ModelConfig,
        PEFTLoraConfig,
        TrainingConfig,
        parse_args_with_yaml,
    )
    from safetensors.torch import save_file

    base = build_qwen2vl_base(out / "Qwen2-VL-tiny", [INSTRUCTION, prompt_with_special_token] + _CORPUS, seed)
    cfg = yaml.safe_load((Path(hpsv3.__file__).parent / "config" / "HPSv3_7B.yaml").read_text())
    cfg.update(model_name_or_path=str(base), bf16=False, torch_dtype="float32")
    cfg_path = out / "hpsv3-tiny.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    (data_config, training_args, model_config, peft_config), _ = parse_args_with_yaml(
        (DataConfig, TrainingConfig, ModelConfig, PEFTLoraConfig), str(cfg_path), is_train=False)
    torch.manual_seed(seed)
    model, _, _ = create_model_and_processor(model_config=model_config, peft_lora_config=peft_config,
                                             training_args=training_args)
    # the untrained head (initializer_range 0.02) maps every input to nearly the same (mu, sigma);
    # 1/sqrt(fan_in) weights keep the random model's scores input-dependent
    for layer in model.rm_head.modules():
        if isinstance(layer, torch.nn.Linear):
            torch.nn.init.normal_(layer.weight, std=layer.in_features ** -0.5)
    ckpt = out / "HPSv3.safetensors"
    save_file({k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}, str(ckpt))
    return {"weights": str(ckpt), "processor": str(base),
            "model_class": type(model).__module__ + "." + type(model).__qualname__}


BUILDERS = {"hpsv2": build_hpsv2, "imagereward": build_imagereward, "hpsv3": build_hpsv3}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    seed = 0
    if "--seed" in args:
        i = args.index("--seed")
        seed = int(args[i + 1])
        del args[i : i + 2]
    if len(args) != 2 or args[0] not in BUILDERS:
        sys.stderr.write(f"usage: python -m chunkgrpo.testing.tiny_scorers {{{','.join(BUILDERS)}}} "
                         "OUT_DIR [--seed N]\n")
        return 2
    out = Path(args[1])
    out.mkdir(parents=True, exist_ok=True)
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # the packages print; keep stdout for the result line
    result = BUILDERS[args[0]](out, seed)
    real_stdout.write(json.dumps(result) + "\n")
    real_stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
