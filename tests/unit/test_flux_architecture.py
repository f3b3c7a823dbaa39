"""Only the FLUX.1 architecture is taken: a diffusers folder of another model (Stable Diffusion 3, Qwen-Image)
is refused by train, evaluate, profile and capacity in one line naming the class found and the supported
ones, before anything is loaded (without the check SD3 crashed in train on CLIP's output and in capacity on
a broadcast). The folders are tiny, built from diffusers' own classes and saved as diffusers saves them."""

import json
from pathlib import Path

import pytest
import torch

from chunkgrpo.errors import UserError
from chunkgrpo.flux import check_architecture, check_model_folder, load_flux, resolve_model_source

SUPPORTED = "supported: FluxPipeline with FluxTransformer2DModel"


def build_tiny_sd3(out: Path) -> Path:
    """A complete StableDiffusion3Pipeline folder with random weights (three text encoders, VAE, MMDiT)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from chunkgrpo.testing.tiny import build_clip_tokenizer, build_t5_tokenizer

    torch.manual_seed(0)
    tok = build_clip_tokenizer(out.parent / f"{out.name}-tokenizer")
    tok3 = build_t5_tokenizer()

    def clip():
        return CLIPTextModelWithProjection(
            CLIPTextConfig(
                vocab_size=len(tok),
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                max_position_embeddings=77,
                projection_dim=16,
                bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        )

    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            caption_projection_dim=16,
            pooled_projection_dim=32,
            out_channels=4,
            pos_embed_max_size=16,
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=AutoencoderKL(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            block_out_channels=(8,),
            norm_num_groups=4,
            sample_size=32,
        ),
        text_encoder=clip(),
        tokenizer=tok,
        text_encoder_2=clip(),
        tokenizer_2=tok,
        text_encoder_3=T5EncoderModel(
            T5Config(
                vocab_size=len(tok3),
                d_model=16,
                d_kv=8,
                d_ff=32,
                num_layers=1,
                num_heads=2,
                pad_token_id=0,
                eos_token_id=1,
            )
        ),
        tokenizer_3=tok3,
    )
    pipe.save_pretrained(out)
    return out


def build_tiny_qwen_image(out: Path) -> Path:
    """A QwenImagePipeline folder: its transformer saved by diffusers and the model_index.json diffusers
    writes for the pipeline (no Qwen2.5-VL text encoder: nothing may get as far as loading it)."""
    from diffusers import QwenImageTransformer2DModel

    QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(2, 2, 4),
    ).save_pretrained(out / "transformer")
    import diffusers

    (out / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "QwenImagePipeline",
                "_diffusers_version": diffusers.__version__,
                "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
                "tokenizer": ["transformers", "Qwen2Tokenizer"],
                "transformer": ["diffusers", "QwenImageTransformer2DModel"],
                "vae": ["diffusers", "AutoencoderKLQwenImage"],
            }
        )
    )
    return out


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    root = tmp_path_factory.mktemp("foreign")
    return {
        "sd3": (
            build_tiny_sd3(root / "sd3"),
            "StableDiffusion3Pipeline with transformer SD3Transformer2DModel",
        ),
        "qwen": (
            build_tiny_qwen_image(root / "qwen"),
            "QwenImagePipeline with transformer QwenImageTransformer2DModel",
        ),
    }


KINDS = ["sd3", "qwen"]


def _refused(excinfo, folder, found):
    msg = str(excinfo.value)
    assert "\n" not in msg and f"model {folder} is {found}; {SUPPORTED}" in msg, msg


def test_the_folders_are_what_diffusers_writes(foreign):
    index = json.loads((foreign["sd3"][0] / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert json.loads((foreign["sd3"][0] / "transformer" / "config.json").read_text())["_class_name"] == (
        "SD3Transformer2DModel"
    )
    assert json.loads((foreign["qwen"][0] / "transformer" / "config.json").read_text())["_class_name"] == (
        "QwenImageTransformer2DModel"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_train_refuses_before_loading(foreign, kind, tmp_path):
    from chunkgrpo.train.config import TrainConfig
    from chunkgrpo.train.trainer import run_training

    folder, found = foreign[kind]
    (tmp_path / "p.txt").write_text("a cat\n")
    cfg = TrainConfig.load(
        "tiny_cpu",
        [
            f"model={folder}",
            f"prompts={tmp_path / 'p.txt'}",
            f"output_dir={tmp_path / 'out'}",
            "progress=false",
        ],
    )
    with pytest.raises(UserError) as e:
        run_training(cfg)
    _refused(e, folder, found)
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.parametrize("kind", KINDS)
def test_evaluate_refuses(foreign, kind, tmp_path):
    from chunkgrpo.eval.config import EvalConfig
    from chunkgrpo.eval.runner import run_evaluation

    folder, found = foreign[kind]
    cfg = EvalConfig.load("eval_tiny", [f"base_model={folder}", f"output_dir={tmp_path / 'e'}"])
    with pytest.raises(UserError) as e:
        run_evaluation(cfg)
    _refused(e, folder, found)
    assert not (tmp_path / "e").exists()  # refused before anything is written


@pytest.mark.parametrize("kind", KINDS)
def test_profile_refuses(foreign, kind, tmp_path):
    from chunkgrpo.dynamics import ProfileConfig, run_profile

    folder, found = foreign[kind]
    (tmp_path / "p.txt").write_text("a cat\n")
    cfg = ProfileConfig(
        model=str(folder), prompts=str(tmp_path / "p.txt"), out=str(tmp_path / "profile.json")
    )
    with pytest.raises(UserError) as e:
        run_profile(cfg, progress=False)
    _refused(e, folder, found)
    assert not (tmp_path / "profile.json").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_capacity_refuses(foreign, kind):
    from chunkgrpo.capacity.plan import capacity_plan
    from chunkgrpo.capacity.pool import local_pool
    from chunkgrpo.train.config import TrainConfig

    folder, found = foreign[kind]
    with pytest.raises(UserError) as e:
        capacity_plan(TrainConfig.load("tiny_cpu", [f"model={folder}"]), local_pool(), device="cpu")
    _refused(e, folder, found)


def test_capacity_refuses_an_s3_folder_of_another_architecture(foreign):
    """The S3 path reads model_index.json and the transformer config (small reads) and refuses too."""
    from chunkgrpo.capacity.arch import ModelArch

    folder, found = foreign["sd3"]

    class Store:  # the two reads the check needs, from the local folder
        def get_bytes(self, uri):
            return (folder / uri.removeprefix("s3://b/m/")).read_bytes()

    with pytest.raises(UserError) as e:
        ModelArch.from_s3("s3://b/m", store=Store())
    _refused(e, "s3://b/m", found)


def test_flux_folders_pass(tiny_model_dir):
    """The supported architecture goes through every check (the tiny FLUX is a FluxPipeline folder)."""
    from chunkgrpo.capacity.arch import ModelArch

    check_model_folder(tiny_model_dir)
    assert resolve_model_source(tiny_model_dir) == str(tiny_model_dir)
    assert ModelArch.from_folder(tiny_model_dir).transformer["in_channels"] == 64
    assert load_flux(tiny_model_dir, with_text_encoders=False, with_vae=False).transformer is not None


@pytest.mark.parametrize(
    "index,config,found",
    [
        (
            {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]},
            None,
            "StableDiffusionPipeline",
        ),
        (
            {"_class_name": "FluxPipeline", "transformer": ["diffusers", "Flux2Transformer2DModel"]},
            None,
            "FluxPipeline with transformer Flux2Transformer2DModel",
        ),
        (
            {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]},
            {"_class_name": "SD3Transformer2DModel"},
            "FluxPipeline with transformer FluxTransformer2DModel, SD3Transformer2DModel",
        ),
        (
            {"_class_name": "FluxKontextPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]},
            None,
            "FluxKontextPipeline with transformer FluxTransformer2DModel",
        ),
    ],
)
def test_check_architecture_names_what_it_found(index, config, found):
    with pytest.raises(UserError, match=f"^model m is {found}; {SUPPORTED}"):
        check_architecture(index, config, "m")


def test_check_architecture_leaves_absent_names_to_loading():
    check_architecture({}, None, "m")  # no class names: loading says what is missing
    check_architecture(
        {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]},
        {"_class_name": "FluxTransformer2DModel"},
        "m",
    )
