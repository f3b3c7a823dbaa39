"""The method switch and the training-length unit in the compiled train_and_evaluate IR."""

import pytest
import yaml

from chunkgrpo.recipes import METHOD_PRESETS, preset_for
from chunkgrpo.train.config import TrainConfig
from pipeline.compile import compile_pipeline


@pytest.fixture(scope="module", params=["torchrun", "trainjob"])
def ir(request, tmp_path_factory):
    path = compile_pipeline(
        "train_and_evaluate", tmp_path_factory.mktemp("c") / "p.yaml", trainer=request.param
    )
    return next(yaml.safe_load_all(path.read_text())), request.param


def _tasks(spec):
    out = {}
    for comp in [spec["root"], *spec["components"].values()]:
        out.update((comp.get("dag") or {}).get("tasks") or {})
    return out


def test_method_switch_reaches_profile_and_train_with_the_methods_own_preset(ir):
    spec, trainer = ir
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert {"tempflow", "granular"} <= set(params["method"]["literals"])
    assert params["preset"]["defaultValue"] == ""  # '' = the method's own preset
    assert "tempflow_grpo_flux" in params["preset"]["description"]
    t = _tasks(spec)
    train = t["train" if trainer == "torchrun" else "launch-trainjob"]["inputs"]["parameters"]
    prof = t["profile"]["inputs"]["parameters"]
    for task in (train, prof):
        assert task["method"]["componentInputParameter"].endswith(
            "method"
        )  # (inside the exit handler: pipelinechannel--)
        assert task["preset"]["componentInputParameter"].endswith("preset")


def test_training_length_parameter_names_its_unit(ir):
    spec, trainer = ir
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert "max_steps" not in params
    assert params["max_iterations"]["defaultValue"] == 0  # the preset's length
    assert "ROLLOUTS" in params["max_iterations"]["description"]
    t = _tasks(spec)
    train = t["train" if trainer == "torchrun" else "launch-trainjob"]["inputs"]["parameters"]
    assert train["max_iterations"]["componentInputParameter"].endswith("max_iterations")


@pytest.mark.parametrize("method", list(METHOD_PRESETS))
def test_each_methods_preset_trains_that_method(method):
    assert TrainConfig.load(preset_for(method)).method == method
    assert preset_for(method, "tiny_cpu") == "tiny_cpu"
