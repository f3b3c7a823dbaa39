"""The bad inputs the CLI is tried with (`tests/unit/test_cli_bad_inputs.py`): `BAD_INPUTS` maps each case
to (argv builder over a workspace, the text its one error line must contain), one bad input per case."""

from __future__ import annotations

import json
import os
from pathlib import Path

NON_UTF8 = b"a cat\n\xff\xfe caf\xe9\n"
BINARY = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"


def _write(ws: Path, name: str, data: bytes | str) -> str:
    p = ws / name
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(p)


def _train(*over: str):
    return lambda ws: ["train", "--dry-run", "--config", "tiny_cpu", f"model={ws / 'model'}",
                       f"prompts={ws / 'prompts.txt'}", f"output_dir={ws / 'run'}", *over]


def _prompts(name: str, data: bytes | str | None):
    def argv(ws):
        path = str(ws / "adir") if data is None else _write(ws, name, data)
        return _train(f"prompts={path}")(ws)
    return argv


def _profile(name: str, data: bytes | str | None):
    def argv(ws):
        path = str(ws / "adir") if data is None else _write(ws, name, data)
        return ["plan", "--profile", path, "--chunks", "step", "--out", str(ws / "plan.json")]
    return argv


def _preset(name: str, data: bytes | str | None):
    def argv(ws):
        path = str(ws / "adir") if data is None else _write(ws, name, data)
        return ["train", "--config", path, "--dry-run"]
    return argv


def _chunks(data: bytes | str | None):
    def argv(ws):
        if data is None:
            (ws / "dirplan.json").mkdir()
            path = str(ws / "dirplan.json")
        else:
            path = _write(ws, "plan.json", data)
        return _train(f"chunks={path}")(ws)
    return argv


def _register(*extra: str, name: str = "tiny-lora", files: dict | None = None):
    def argv(ws):
        for fname, data in (files or {}).items():
            _write(ws, fname, data)
        return ["register", "--model-dir", str(ws / "model"), "--name", name, "--base-model", "tiny",
                *[a.format(ws=ws) for a in extra]]
    return argv


def _plan(strategy: str):
    return lambda ws: ["plan", "--profile", str(ws / "profile.json"), "--chunks", strategy,
                       "--out", str(ws / "plan.json")]


BAD_INPUTS = {
    # prompts (train --dry-run validates them before any model is loaded)
    "prompts: not UTF-8 (.txt)": (_prompts("p.txt", NON_UTF8), "not UTF-8 text"),
    "prompts: binary (.txt)": (_prompts("p.txt", BINARY), "binary file"),
    "prompts: a directory": (_prompts("", None), "is a directory"),
    "prompts: not UTF-8 (.jsonl)": (_prompts("p.jsonl", NON_UTF8), "not UTF-8 text"),
    "prompts: invalid JSON line": (_prompts("p.jsonl", '{"prompt": "a"}\n{oops\n'), "invalid JSON"),
    "prompts: JSON line not an object": (_prompts("p.jsonl", '["a cat"]\n'), "expected a JSON object"),
    "prompts: not UTF-8 (.tsv)": (_prompts("p.tsv", b"Prompt\n\xff\xfe\n"), "not UTF-8 text"),
    "prompts: .tsv without a prompt column": (_prompts("p.tsv", "id\tx\n1\t2\n"), "no prompt field"),
    "prompts: .parquet that is not parquet": (_prompts("p.parquet", BINARY), "not a readable parquet"),
    "prompts: empty file": (_prompts("p.txt", "\n# only a comment\n"), "contains no prompts"),
    "prompts: empty prompt entry": (_prompts("p.jsonl", '{"prompt": "  "}\n'), "empty prompt"),
    "prompts: missing file": (lambda ws: _train(f"prompts={ws / 'nope.txt'}")(ws), "does not exist"),
    # profiles (plan --profile)
    "profile: not UTF-8": (_profile("prof.json", NON_UTF8), "not UTF-8 text"),
    "profile: binary": (_profile("prof.json", BINARY), "binary file"),
    "profile: a directory": (_profile("", None), "is a directory"),
    "profile: invalid JSON": (_profile("prof.json", "{nope"), "not valid JSON"),
    "profile: a JSON list": (_profile("prof.json", "[1, 2]"), "expected a JSON object"),
    "profile: l1rel not a list": (_profile("prof.json", '{"sigmas": [1, 0], "l1rel": 3}'), "no 'l1rel' list"),
    "profile: NaN in l1rel": (
        _profile("prof.json", '{"sigmas": [1, 0.5, 0.2, 0], "l1rel": [0.3, NaN, 0.1]}'),
        "finite numbers",
    ),
    # presets / config files
    "preset: not UTF-8": (_preset("c.yaml", b"lr: 1e-5\n# \xff\n"), "not UTF-8 text"),
    "preset: binary": (_preset("c.yaml", BINARY), "binary file"),
    "preset: a directory": (_preset("", None), "is a directory"),
    "preset: invalid YAML": (_preset("c.yaml", "lr: [1, 2\n"), "invalid YAML"),
    "preset: top level not a mapping": (_preset("c.yaml", "- lr\n- 1\n"), "expected a mapping"),
    "preset: unknown preset name": (
        lambda ws: ["train", "--config", "no_such_preset", "--dry-run"],
        "neither a file nor a preset",
    ),
    # chunk plans (train chunks=plan.json)
    "chunks: plan not UTF-8": (_chunks(NON_UTF8), "not UTF-8 text"),
    "chunks: plan is a directory": (_chunks(None), "is a directory"),
    "chunks: sizes not integers": (_chunks('{"sizes": ["2", "5"]}'), "must be a list of integers"),
    "chunks: sizes do not sum to the steps": (_chunks('{"sizes": [2, 2]}'), "trainable steps"),
    # metrics / plan files for register (read before MLflow is contacted)
    "metrics: not UTF-8": (
        _register("--metrics", "{ws}/m.json", files={"m.json": NON_UTF8}),
        "not UTF-8 text",
    ),
    "metrics: a directory": (_register("--metrics", "{ws}/adir"), "is a directory"),
    "metrics: invalid JSON": (
        _register("--metrics", "{ws}/m.json", files={"m.json": "{x"}),
        "not valid JSON",
    ),
    "register plan: binary": (_register("--plan", "{ws}/p.json", files={"p.json": BINARY}), "binary file"),
    # register validates the name before anything is uploaded (MLflow is unreachable here: order proven)
    "register: name with '/'": (_register(name="team/model"), "not a valid registered model name"),
    "register: name with ':'": (_register(name="model:v1"), "not a valid registered model name"),
    "register: blank name": (_register(name="  "), "not a valid registered model name"),
    # float options: NaN/inf pass every `x < 0` check, so they are rejected by name
    "lr=nan": (_train("lr=nan"), "lr=nan"),
    "lr=inf": (_train("lr=inf"), "lr=inf"),
    "max_grad_norm=nan": (_train("max_grad_norm=nan"), "max_grad_norm"),
    "max_grad_norm=-1": (_train("max_grad_norm=-1"), "max_grad_norm must be >= 0"),
    "sampling.eta=inf": (_train("sampling.eta=inf"), "sampling.eta"),
    "sampling.shift=nan": (_train("sampling.shift=nan"), "sampling.shift"),
    "sampling.shift=0": (_train("sampling.shift=0"), "shift must be > 0"),
    "clip_high=-inf": (_train("clip_high=-inf"), "clip_high"),
    "rewards.0.weight=nan": (_train("rewards.0.weight=nan"), "weight"),
    "lora.dropout=1.5": (_train("lora.dropout=1.5"), "lora.dropout"),
    "betas=[0.9, 1.5]": (_train("betas=[0.9, 1.5]"), "betas"),
    "checkpoint.every=-1": (_train("checkpoint.every=-1"), "checkpoint.every must be >= 0"),
    "checkpoint.keep=-2": (_train("checkpoint.keep=-2"), "checkpoint.keep must be >= 0"),
    "tracking.timeout_s=0": (_train("tracking.timeout_s=0"), "tracking.timeout_s"),
    "device=tpu": (_train("device=tpu"), "device='tpu'"),
    "device=cuda:first": (_train("device=cuda:first"), "device='cuda:first'"),
    # S3 locations
    "s3_prefix without s3://": (_train("checkpoint.s3_prefix=bucket/ckpt"), "is not an S3 URI"),
    "s3_prefix with a bad bucket": (
        _train("checkpoint.s3_prefix=s3://Bad_Bucket/ckpt"),
        "invalid bucket name",
    ),
    "s3_prefix with '..'": (_train("checkpoint.s3_prefix=s3://bucket/a/../b"), "'..' are not allowed"),
    "register from an S3 key with '..'": (_register(name="ok"), None),  # replaced below (needs env)
    # dynamics planner options
    "dynamics:rel=-0.1": (_plan("dynamics:rel=-0.1"), "rel=-0.1"),
    "dynamics:rel=nan": (_plan("dynamics:rel=nan"), "rel=nan"),
    "dynamics:min=4,max=2": (_plan("dynamics:min=4,max=2"), "min=4 is larger than max=2"),
    "dynamics:max=abc": (_plan("dynamics:max=abc"), "bad dynamics option"),
    "dynamics:last=2": (_plan("dynamics:last=2"), "last fraction"),
    "unknown strategy": (_plan("zigzag"), "unknown chunk strategy"),
    # outputs that would overwrite or half-write something
    "tiny-model --out <file>": (
        lambda ws: ["tiny-model", "--out", _write(ws, "f.bin", b"data")],
        "not a directory",
    ),
    "tiny-model --out <non-empty dir>": (
        lambda ws: ["tiny-model", "--out", str(ws / "adir")],
        "non-empty directory",
    ),
    "tiny-model --overwrite on a foreign dir": (
        lambda ws: ["tiny-model", "--out", str(ws / "adir"), "--overwrite"],
        "not made by",
    ),
    "plan --out <existing dir>": (
        lambda ws: [
            "plan",
            "--profile",
            str(ws / "profile.json"),
            "--chunks",
            "step",
            "--out",
            str(ws / "adir"),
        ],
        "is a directory",
    ),
    "profile --out <existing dir>": (
        lambda ws: [
            "profile",
            "--model",
            str(ws / "model"),
            "--prompts",
            str(ws / "prompts.txt"),
            "--out",
            str(ws / "adir"),
        ],
        "is a directory",
    ),
}


# ---- unreadable, special and damaged inputs (train/plan/profile/tiny-model/evaluate side) ----
def _fifo(ws: Path, name: str = "fifo.txt") -> str:
    path = ws / name
    if not path.exists():
        os.mkfifo(path)
    return str(path)


TINY_MODEL: dict = {}  # {"dir": callable → the session's tiny model folder}, set by the test (on demand)


def _real_model(ws: Path, damage: str | None = None) -> str:
    """A real tiny FLUX folder copied into the workspace (from the session fixture), optionally damaged."""
    import shutil

    target = ws / "real-model"
    if not target.exists():
        shutil.copytree(TINY_MODEL["dir"](), target)
    if damage == "truncated safetensors":
        f = target / "transformer" / "diffusion_pytorch_model.safetensors"
        f.write_bytes(f.read_bytes()[:1000])
    return str(target)


def _earlier_tiny_model_with_a_user_file(ws: Path) -> list[str]:
    from chunkgrpo.testing.tiny import build_tiny_flux

    out = ws / "tm"
    if not out.exists():
        build_tiny_flux(out, seed=0)
        (out / "transformer" / "my-notes.txt").write_text("not made by tiny-model")
    return ["tiny-model", "--out", str(out), "--overwrite", "--seed", "1"]


def _truncated_lora(ws: Path) -> list[str]:
    from safetensors.torch import save_file

    lora = ws / "lora"
    lora.mkdir(exist_ok=True)
    f = lora / "pytorch_lora_weights.safetensors"
    if not f.exists():
        import torch

        save_file({"transformer.x.lora_A.weight": torch.zeros(64, 64)}, str(f))
        f.write_bytes(f.read_bytes()[:-4000])
        (lora / "chunkgrpo_model.json").write_text(
            json.dumps({"kind": "lora", "base_model": str(ws / "model")})
        )
    return ["evaluate", "--config", "eval_tiny", f"model={lora}", f"base_model={ws / 'model'}",
            f"output_dir={ws / 'eval-out'}"]


BAD_INPUTS.update(
    {
        # destructive (item 10)
        "tiny-model --overwrite over a user file in an earlier model": (
            _earlier_tiny_model_with_a_user_file,
            "transformer/my-notes.txt",
        ),
        "train output_dir=''": (_train("output_dir="), "output_dir='' is empty"),
        # hangs (item 11)
        "plan: a 2M-step profile": (
            _profile(
                "big.json",
                '{"sigmas": ['
                + ",".join(["0.5"] * 2_000_001)
                + '], "l1rel": ['
                + ",".join(["0.1"] * 2_000_000)
                + "]}",
            ),
            "2000000 transitions",
        ),
        "prompts: a FIFO": (lambda ws: _train(f"prompts={_fifo(ws)}")(ws), "is not a regular file"),
        "profile: a FIFO": (
            lambda ws: [
                "plan",
                "--profile",
                _fifo(ws, "prof.json"),
                "--chunks",
                "step",
                "--out",
                str(ws / "plan.json"),
            ],
            "is not a regular file",
        ),
        # tracebacks (item 12)
        "plan --out a FIFO (rename would replace it)": (
            lambda ws: [
                "plan",
                "--profile",
                str(ws / "profile.json"),
                "--chunks",
                "step",
                "--out",
                _fifo(ws, "o.json"),
            ],
            "not a regular file",
        ),
        "profile --out a FIFO": (
            lambda ws: [
                "profile",
                "--model",
                str(ws / "model"),
                "--prompts",
                str(ws / "prompts.txt"),
                "--out",
                _fifo(ws, "o.json"),
            ],
            "not a regular file",
        ),
        "plan --out under a file": (
            lambda ws: [
                "plan",
                "--profile",
                str(ws / "profile.json"),
                "--chunks",
                "step",
                "--out",
                str(ws / "adir" / "keep.txt" / "plan.json"),
            ],
            "keep.txt",
        ),
        "tiny-model --out under a file": (
            lambda ws: ["tiny-model", "--out", str(ws / "adir" / "keep.txt" / "m")],
            "keep.txt",
        ),
        "local up --home under a file": (
            lambda ws: ["local", "up", "--home", str(ws / "adir" / "keep.txt" / "h")],
            "keep.txt",
        ),
        "profile --out under a file": (
            lambda ws: [
                "profile",
                "--model",
                str(ws / "model"),
                "--prompts",
                str(ws / "prompts.txt"),
                "--out",
                str(ws / "adir" / "keep.txt" / "p.json"),
            ],
            "keep.txt is a file",
        ),
        "train output_dir under a file": (
            lambda ws: [
                a
                for a in _train(f"output_dir={ws / 'adir' / 'keep.txt' / 'r'}", "max_steps=1")(ws)
                if a != "--dry-run"
            ],
            "keep.txt",
        ),
        "evaluate output_dir under a file": (
            lambda ws: [
                "evaluate",
                "--config",
                "eval_tiny",
                f"base_model={ws / 'model'}",
                f"output_dir={ws / 'adir' / 'keep.txt' / 'e'}",
            ],
            "keep.txt",
        ),
        "seed=2**80": (_train(f"seed={2**80}"), f"seed={2**80}"),
        "train: model_index.json {}": (
            lambda ws: [a for a in _train("max_steps=1")(ws) if a != "--dry-run"],
            "not a loadable FLUX pipeline folder",
        ),
        "train: truncated transformer safetensors": (
            lambda ws: [
                a
                for a in _train(f"model={_real_model(ws, 'truncated safetensors')}", "max_steps=1")(ws)
                if a != "--dry-run"
            ],
            "not a loadable FLUX pipeline folder",
        ),
        "train lora.targets=[no_such_module]": (
            lambda ws: [
                a
                for a in _train(f"model={_real_model(ws)}", "max_steps=1", "lora.targets=[no_such_module]")(
                    ws
                )
                if a != "--dry-run"
            ],
            "lora.targets=['no_such_module']",
        ),
        "prompts=s3://bucket (bucket root)": (
            _train("prompts=s3://chunkgrpo"),
            "prompts=s3://chunkgrpo names a bucket",
        ),
        "evaluate device=tpu": (
            lambda ws: [
                "evaluate",
                "--config",
                "eval_tiny",
                f"base_model={ws / 'model'}",
                "device=tpu",
                f"output_dir={ws / 'e'}",
            ],
            "device='tpu'",
        ),
        "evaluate: a truncated LoRA": (
            _truncated_lora,
            "pytorch_lora_weights.safetensors is not a readable safetensors",
        ),
        # silently accepted (item 13)
        "profile: negative l1rel": (
            _profile("prof.json", '{"sigmas": [1, 0.8, 0.5, 0], "l1rel": [0.3, -0.2, 0.1]}'),
            "l1rel[1]=-0.2 is negative",
        ),
        "sampling.max_sequence_length=0": (
            _train("sampling.max_sequence_length=0"),
            "sampling.max_sequence_length=0",
        ),
        "prompts: NUL byte past the first 8 KiB": (
            _prompts("p.txt", "a cat\n" * 2000 + "a d\x00og\n"),
            "NUL byte at offset 12003",
        ),
        "prompts: NUL inside a .jsonl prompt": (
            _prompts("p.jsonl", '{"prompt": "a\\u0000cat"}\n'),
            "contains a NUL character",
        ),
    }
)
BAD_INPUTS["register from an S3 key with '..'"] = (
    lambda ws: [
        "register",
        "--model-dir",
        "s3://chunkgrpo/runs/../x",
        "--name",
        "ok",
        "--base-model",
        "tiny",
    ],
    "'..' are not allowed",
)



def _parquet(ws: Path, name: str, cells: list) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = ws / name
    if not path.exists():
        pq.write_table(pa.table({"prompt": cells}), path)
    return str(path)


def _runtime_with(ws: Path, **limits) -> str:
    import yaml

    pod = {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H800"},
           "containers": [{"name": "node", "resources": {"limits": {"nvidia.com/gpu": 8, **limits}}}]}
    rt = {"kind": "ClusterTrainingRuntime", "metadata": {"name": "chunkgrpo-torch"},
          "spec": {"template": {"spec": {"replicatedJobs": [
              {"template": {"spec": {"template": {"spec": pod}}}}]}}}}
    return _write(ws, "runtime.yaml", yaml.safe_dump(rt))


def _capacity(*extra: str):
    return lambda ws: ["capacity", "--config", "chunk_grpo_flux", "--pool", "h800", *extra]


BAD_INPUTS.update(
    {
        # prompt cells that are not strings are refused by row, never trained on as 'None' or a number
        "prompts: .parquet with a null prompt": (
            lambda ws: _train(f"prompts={_parquet(ws, 'p.parquet', ['a cat', None])}")(ws),
            "row 1 is null",
        ),
        "prompts: .parquet with integer prompts": (
            lambda ws: _train(f"prompts={_parquet(ws, 'p.parquet', [1, 2])}")(ws),
            "row 0 is int '1'",
        ),
        "prompts: .parquet with bytes prompts": (
            lambda ws: _train(f"prompts={_parquet(ws, 'p.parquet', [b'a cat'])}")(ws),
            "row 0 is bytes",
        ),
        "prompts: .jsonl with a null prompt": (
            _prompts("p.jsonl", '{"prompt": "a cat"}\n{"prompt": null}\n'),
            "p.jsonl:2: field 'prompt' is null",
        ),
        "prompts: .jsonl with a number prompt": (
            _prompts("p.jsonl", '{"prompt": 7}\n'),
            "field 'prompt' is int '7'",
        ),
        "evaluate hpdv2_prompts=<binary file>": (
            lambda ws: ["evaluate", "--config", "eval_tiny", f"base_model={ws / 'model'}",
                        f"hpdv2_prompts={_write(ws, 'h.txt', BINARY)}", f"output_dir={ws / 'e'}"],
            "HPDv2 prompt file",
        ),
        # numbers out of range
        "tiny-model --seed 2**80": (
            lambda ws: ["tiny-model", "--out", str(ws / "tm"), "--seed", str(2**80)],
            f"seed={2**80} must be in 0..4294967295",
        ),
        "capacity: 10**15 samples per rank (tensor sizes overflow)": (
            _capacity("group_size=1000000000", "prompts_per_rank=1000000", "grad_accum=1"),
            "1000000000000000 samples per rank",
        ),
        "train group_size=10**9": (_train("group_size=1000000000", "grad_accum=1"), "samples per rank"),
        "capacity --runtime with a negative memory limit": (
            lambda ws: _capacity("--runtime", _runtime_with(ws, memory="-16Gi"))(ws),
            "limits.memory='-16Gi' must be a non-negative quantity",
        ),
        "capacity --runtime with a negative GPU count": (
            lambda ws: _capacity("--runtime", _runtime_with(ws, **{"nvidia.com/gpu": -8}))(ws),
            "limits.nvidia.com/gpu=-8",
        ),
        "capacity --runtime with a malformed quantity": (
            lambda ws: _capacity("--runtime", _runtime_with(ws, **{"ephemeral-storage": "lots"}))(ws),
            "limits.ephemeral-storage='lots' is not a Kubernetes quantity",
        ),
        "local up --timeout nan": (
            lambda ws: ["local", "up", "--home", str(ws / "h"), "--timeout", "nan"],
            "--timeout nan",
        ),
        "local up --timeout -1": (
            lambda ws: ["local", "up", "--home", str(ws / "h"), "--timeout", "-1"],
            "--timeout -1.0",
        ),
        # s3:// model URIs are checked (bucket naming, no '..') before anything is read or written
        "train model=s3://Bad_Bucket/x": (
            _train("model=s3://Bad_Bucket/x"),
            "invalid bucket name 'Bad_Bucket'",
        ),
        "train model=s3://chunkgrpo/a/../b": (
            _train("model=s3://chunkgrpo/a/../b"),
            "'..' are not allowed",
        ),
    }
)
