"""profile: python_func on the tiny FLUX model (CPU), with the training preset's sampling."""

import json

from components.profile.component import profile


def test_profile_tiny(tiny_model_dir, tmp_path, artifact):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\na dog\n")
    out, plot = artifact("profile.json"), artifact("plot.png")
    profile.python_func(model=str(tiny_model_dir), prompts=str(prompts), preset="tiny_cpu",
                        overrides=["sampling.num_steps=6"], num_prompts=2, seeds=1, device="cpu",
                        profile_json=out, plot=plot)
    prof = json.loads(open(out.path).read())
    assert len(prof["l1rel"]) == 6 and len(prof["sigmas"]) == 7  # the override reached the profile
    assert out.metadata["num_steps"] == 6
