"""profile: python_func on the tiny FLUX model (CPU), with the training preset's sampling."""

import json

from components.profile.component import profile


def test_profile_tiny(tiny_model_dir, tmp_path, artifact):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\na dog\n")
    out, plot = artifact("profile.json"), artifact("plot.html")
    profile.python_func(model=str(tiny_model_dir), prompts=str(prompts), preset="tiny_cpu",
                        overrides=["sampling.num_steps=6"], num_prompts=2, seeds=1, device="cpu",
                        profile_json=out, plot=plot)
    prof = json.loads(open(out.path).read())
    assert len(prof["l1rel"]) == 6 and len(prof["sigmas"]) == 7  # the override reached the profile
    assert out.metadata["num_steps"] == 6
    page = open(plot.path).read()  # the KFP UI renders this HTML: the PNG inline and the per-step values
    assert page.startswith("<!DOCTYPE html>") and '<img src="data:image/png;base64,iVBORw0KGgo' in page
    assert "6 sampling steps" in page and page.count("<tr><td>") == 6 and "L1rel SDE (planned on)" in page
