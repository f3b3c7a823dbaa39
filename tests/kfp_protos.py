"""The protos of the KFP backends chunkgrpo supports, vendored as serialized descriptor sets
(tests/fixtures/kfp/<version>/kfp-<version>.desc: `pipeline_spec.proto` of kfp-pipeline-spec and
`kubernetes_executor_config.proto` of kfp-kubernetes at that release, plus their imports).

A KFP API server unmarshals the pipeline spec and every executor's Kubernetes config strictly
(protojson, unknown fields rejected), so `parse_ir` with a version's protos is what that backend
does with a compiled package: a field the version lacks raises `json_format.ParseError`.
"""

from __future__ import annotations

import functools
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "kfp"


@functools.lru_cache(maxsize=None)
def messages(version: str) -> dict:
    """{"PipelineSpec", "PlatformSpec", "KubernetesExecutorConfig"}: message classes of `version`,
    built in a private descriptor pool (never the installed kfp's)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    path = FIXTURES / version / f"kfp-{version}.desc"
    if not path.exists():
        raise FileNotFoundError(f"no vendored KFP {version} protos at {path} "
                                "(see tests/fixtures/kfp/README.md)")
    pool = descriptor_pool.DescriptorPool()
    for f in descriptor_pb2.FileDescriptorSet.FromString(path.read_bytes()).file:  # dependencies first
        pool.Add(f)
    names = {"PipelineSpec": "ml_pipelines.PipelineSpec", "PlatformSpec": "ml_pipelines.PlatformSpec",
             "KubernetesExecutorConfig": "kfp_kubernetes.KubernetesExecutorConfig"}
    return {k: message_factory.GetMessageClass(pool.FindMessageTypeByName(v)) for k, v in names.items()}


def parse_pipeline_spec(spec: dict, version: str) -> None:
    from google.protobuf import json_format

    json_format.ParseDict(spec, messages(version)["PipelineSpec"](), ignore_unknown_fields=False)


def parse_platform_spec(platform: dict, version: str) -> dict[str, str]:
    """Parse the platform document (`platforms: {kubernetes: ...}`) and every executor's config with
    `version`'s protos. Returns {executor: error} for the executors that do not parse ({} = all do)."""
    from google.protobuf import json_format

    m = messages(version)
    json_format.ParseDict(platform, m["PlatformSpec"](), ignore_unknown_fields=False)
    errors = {}
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for name, cfg in executors.items():
        try:
            json_format.ParseDict(cfg, m["KubernetesExecutorConfig"](), ignore_unknown_fields=False)
        except json_format.ParseError as e:
            errors[name] = str(e)
    return errors
