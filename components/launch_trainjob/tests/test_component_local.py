"""launch_trainjob under kfp.local, talking to a FAKE Kubernetes API over HTTP (no cluster exists
here): the real kubernetes client from a kubeconfig, create -> watch -> Complete, the ownerReference
read from the launcher's own pod, the final model read back from the real local S3. The fake
"trainer" writes the final model to S3 when the TrainJob is created."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from components.launch_trainjob.component import launch_trainjob

pytestmark = pytest.mark.integration


class FakeK8s(BaseHTTPRequestHandler):
    objects: dict = {}
    on_create = None

    def log_message(self, *a):
        pass

    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        path, _, query = self.path.partition("?")
        if path.endswith("/pods"):  # the launcher's probe: the job's pods (none blocked)
            return self._send(200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": []})
        if path.endswith("/events"):  # list, then a watch that ends at once
            if "watch=true" in query:
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            return self._send(200, {"apiVersion": "v1", "kind": "EventList",
                                    "metadata": {"resourceVersion": "1"}, "items": []})
        if "/pods/" in self.path:
            return self._send(
                200,
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": self.path.rsplit("/", 1)[1],
                        "namespace": "kubeflow",
                        "ownerReferences": [
                            {
                                "apiVersion": "argoproj.io/v1alpha1",
                                "kind": "Workflow",
                                "name": "wf-local",
                                "uid": "uid-7",
                            }
                        ],
                    },
                },
            )
        obj = self.objects.get(self.path)
        if obj is None:
            return self._send(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
        obj["status"] = {"conditions": [{"type": "Complete", "status": "True", "reason": "JobSetCompleted"}]}
        return self._send(200, obj)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        path, _, query = self.path.partition("?")
        assert "fieldValidation=Strict" in query, self.path  # a field the API server would drop is an error
        self.objects[f"{path}/{body['metadata']['name']}"] = body
        FakeK8s.on_create(body)
        return self._send(201, body)

    def do_DELETE(self):
        return self._send(200 if self.objects.pop(self.path, None) else 404, {"kind": "Status"})


def test_launch_trainjob_locally(local_runner, tmp_path, monkeypatch):
    from chunkgrpo.store.client import ArtifactStore

    store = ArtifactStore()
    bucket = local_runner.env["CHUNKGRPO_S3_BUCKET"]
    root, run_id = f"s3://{bucket}/comp-launch", "launch-run-1"

    def trainer(job):  # what node rank 0 of the real job does at the end (upload-final)
        final = tmp_path / "final"
        final.mkdir(exist_ok=True)
        (final / "pytorch_lora_weights.safetensors").write_bytes(b"\x03" * 256)
        (final / "chunkgrpo_model.json").write_text(json.dumps({"kind": "lora"}))
        store.put_folder(final, f"{root}/{run_id}/train/final")
        store.put_bytes(json.dumps({"chunk_sizes": [3, 3], "optimizer_steps": 4, "config_hash": "c",
                                    "history": [{"reward_mean": 0.5}]}).encode(),
                        f"{root}/{run_id}/train/final.train_summary.json")

    FakeK8s.objects, FakeK8s.on_create = {}, staticmethod(trainer)
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeK8s)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [
                        {"name": "fake", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}
                    ],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [
                        {"name": "fake", "context": {"cluster": "fake", "user": "u", "namespace": "kubeflow"}}
                    ],
                }
            )
        )
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.setenv("HOSTNAME", "launcher-pod")
        task = launch_trainjob(
            kind="TrainJob",
            namespace="kubeflow",
            image="img:1",
            num_nodes=2,
            nproc_per_node=1,
            gpus_per_node=0,
            node_selector={},
            tolerations=[],
            shm_size="",
            model="s3://x/m",
            prompts="/p.txt",
            preset="tiny_cpu",
            method="chunk",
            chunks="sizes:3,3",
            max_iterations=4,
            overrides=[],
            artifact_root=root,
            run_id=run_id,
            experiment="e",
            parent_run_id="",
            timeout_hours=1.0,
        )
        pointer = json.loads(open(task.outputs["trained_model"].path).read())
        assert pointer["uri"] == f"{root}/{run_id}/train/final" and pointer["optimizer_steps"] == 4
        (job,) = FakeK8s.objects.values()
        assert job["metadata"]["ownerReferences"][0]["uid"] == "uid-7"
        from tests import k8s_schemas

        k8s_schemas.check({k: v for k, v in job.items() if k != "status"})  # status: set by the fake API
    finally:
        server.shutdown()
