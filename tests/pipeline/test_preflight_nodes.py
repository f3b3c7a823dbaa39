"""The preflight's capacity plan is made for the training's node count: the multi-node variant passes its
`num_nodes` run parameter (default 2), the single-node torchrun variant one node."""

from __future__ import annotations

import yaml

from pipeline.compile import compile_pipeline


def _preflight_nodes(tmp_path, trainer: str) -> tuple[dict, dict]:
    spec, _ = yaml.safe_load_all(
        compile_pipeline("train_and_evaluate", tmp_path / "p.yaml", pool="h800", trainer=trainer).read_text())
    tasks = {}
    for comp in [spec["root"], *spec["components"].values()]:
        tasks.update((comp.get("dag") or {}).get("tasks") or {})
    return spec["root"]["inputDefinitions"]["parameters"], tasks["preflight"]["inputs"]["parameters"]["nodes"]


def test_multinode_preflight_plans_num_nodes(tmp_path):
    params, nodes = _preflight_nodes(tmp_path, "trainjob")
    assert nodes["componentInputParameter"].endswith("num_nodes")
    assert params["num_nodes"]["defaultValue"] == 2


def test_single_node_preflight_plans_one_node(tmp_path):
    _, nodes = _preflight_nodes(tmp_path, "torchrun")
    assert nodes["runtimeValue"]["constant"] == 1
