"""Fail fast on the cluster (chunkgrpo.k8s.diagnose + launcher.wait/launch) and tolerations merged
the way Trainer merges them.

No cluster exists here. The pods and events are API-shaped objects (tests/fixtures/k8s/failfast.yaml,
field names checked by a round trip through the kubernetes client's models, messages in the
upstream formats); the event stream is the real `kubernetes.watch.Watch` reading a fake HTTP
response; the TrainJob API is the FakeApi of tests/pipeline/trainjob_fakes.py.
"""

import datetime
import json

import pytest

from chunkgrpo.k8s import diagnose as dg
from chunkgrpo.k8s import jobspec, launcher, trainjob
from tests.pipeline.trainjob_fakes import (
    FIX,
    MERGE_KEYS,
    RUNNING_V2,
    FakeApi,
    FakeCore,
    FakeWatchResponse,
    cond,
    effective_trainer_pod,
    event,
    pod,
    prod_runtime,
    spec,
    strategic_merge,
)

JOB = "cg-0123456789-train"
NS = "team-a"
NO_SLEEP = dict(sleep=lambda s: None)




def _model_round_trip(obj: dict, klass: str) -> dict:
    from kubernetes.client import ApiClient

    class Resp:
        data = json.dumps(obj)

    client = ApiClient()
    return client.sanitize_for_serialization(client.deserialize(Resp(), klass))


def _normal(x):
    if isinstance(x, dict):
        return {k: _normal(v) for k, v in x.items() if v is not None and v != {}}
    if isinstance(x, list):
        return [_normal(v) for v in x]
    if isinstance(x, str) and x.endswith("+00:00"):
        return x[:-6] + "Z"
    return x


@pytest.mark.parametrize("section,name,klass", [("pods", n, "V1Pod") for n in FIX["pods"]]
                         + [("events", n, "CoreV1Event") for n in FIX["events"]])
def test_fixtures_use_the_apis_field_names(section, name, klass):
    """A misspelled field would be dropped by the client's model (generated from the API's OpenAPI)."""
    obj = FIX[section][name]
    assert _normal(_model_round_trip(obj, klass)) == _normal(obj)


# ---------------------------------------------------------------------------------- classification


def test_podsecurity_failedcreate_names_the_level_the_capability_and_the_fix():
    f = dg.event_finding(event("podsecurity"))
    assert f.kind == "PodSecurity" and f.grace_s == 0
    line = f.line()
    assert "Job cg-0123456789-train-node-0" in line and '"restricted"' in line and "IPC_LOCK" in line
    assert "pod-security.kubernetes.io/enforce=privileged" in line and "components/rdma" in line
    assert "\n" not in line


def test_quota_failedcreate():
    f = dg.event_finding(event("quota"))
    assert f.kind == "Quota" and "exceeded quota: gpu-quota" in f.cause and "ResourceQuota" in f.fix


def test_pod_states():
    (u,) = dg.pod_findings(pod("unschedulable"), schedule_grace_s=600)
    assert u.kind == "Unschedulable" and u.grace_s == 600 and "Insufficient nvidia.com/gpu" in u.cause
    assert "nvidia.com/gpu.product" in u.fix
    (i,) = dg.pod_findings(pod("image_pull"), pull_grace_s=120)
    assert i.kind == "ImagePull" and i.grace_s == 120 and "ImagePullBackOff" in i.cause
    assert "--image-pull-secret" in i.fix
    (o,) = dg.pod_findings(pod("oom"))
    assert o.kind == "OOMKilled" and o.grace_s == 0 and "1600Gi" in o.cause and "exit code 137" in o.cause
    (e,) = dg.pod_findings(pod("evicted"))
    assert e.kind == "Evicted" and 'EmptyDir volume "tmp" exceeds the limit "10Gi"' in e.cause
    assert "/cache" in e.fix and "CHUNKGRPO_CACHE" in e.fix
    assert dg.pod_findings(pod("running")) == []


def test_invalid_image_name_fails_at_once():
    p = pod("image_pull")
    p["status"]["containerStatuses"][0]["state"]["waiting"] = {"reason": "InvalidImageName",
                                                               "message": 'couldn\'t parse image name "a b"'}
    (f,) = dg.pod_findings(p)
    assert f.grace_s == 0


def test_probe_applies_grace_periods_from_first_sight_and_resets_when_cleared():
    pods = [pod("unschedulable")]
    probe = dg.JobProbe(lambda: pods, list, schedule_grace_s=600)
    assert probe.check(1000.0) is None
    assert probe.check(1599.0) is None
    pods[:] = [pod("running")]          # scheduled after all: the clock starts over
    assert probe.check(1600.0) is None
    pods[:] = [pod("unschedulable")]
    assert probe.check(1700.0) is None
    f = probe.check(2300.0)
    assert f is not None and f.kind == "Unschedulable"


# ----------------------------------------------------------------------------------------- events




def test_event_watch_keeps_this_jobs_warnings_since_its_creation():
    core = FakeCore(events=[event(n) for n in ("podsecurity", "stale_podsecurity", "other_job", "quota")])
    w = dg.EventWatch(core, NS, JOB, since="2026-11-25T13:05:00Z")
    w.pump()
    assert [e["metadata"]["name"] for e in w.events()] == [event("podsecurity")["metadata"]["name"],
                                                           event("quota")["metadata"]["name"]]
    assert core.calls[0][:3] == ("events", NS, True)
    w.pump()  # the next stream resumes from the last resourceVersion seen
    assert core.calls[-1][3] == "918290"
    primed = dg.EventWatch(core, NS, JOB, since="2026-11-25T13:05:00Z").prime()
    assert len(primed.events()) == 2 and core.calls[-1][2] is None  # a plain list first
    primed.pump()
    assert core.calls[-1][2:] == (True, "918400")  # then the watch from the list's resourceVersion


def test_event_watch_restarts_from_now_after_410_gone():
    """An expired resourceVersion (the API's ERROR event, code 410) is not an error: the next stream
    starts without one."""
    core = FakeCore(events=[event("podsecurity")])
    w = dg.EventWatch(core, NS, JOB, since="2026-11-25T13:05:00Z")
    w.pump()
    assert w._resource_version == "918273"
    gone = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410, "reason": "Expired",
            "message": "too old resource version: 918273 (925000)"}
    resp = FakeWatchResponse([])
    resp.lines = [json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n"]
    core.list_namespaced_event = lambda namespace, **kw: resp
    core.list_namespaced_event.__doc__ = ":return: CoreV1EventList"
    w.pump()
    assert w._resource_version is None and resp.closed and len(w.events()) == 1


def test_probe_for_job_reads_pods_by_the_jobset_label_and_streams_events():
    core = FakeCore(pods=[pod("running")], events=[event("podsecurity")])
    obj = {"kind": "TrainJob",
           "metadata": {"name": JOB, "namespace": NS, "creationTimestamp": "2026-11-25T13:05:00Z"}}
    probe = dg.JobProbe.for_job(core, obj, watch_events=False)
    assert probe.check(0.0) is None
    assert core.calls[0] == ("pods", NS, f"jobset.sigs.k8s.io/jobset-name={JOB}")
    probe.events = dg.EventWatch(core, NS, JOB, since="2026-11-25T13:05:00Z").prime().events
    assert probe.check(1.0).kind == "PodSecurity"  # from the list (model objects -> API dicts)
    ptj = {"kind": "PyTorchJob", "metadata": {"name": JOB, "namespace": NS}}
    dg.JobProbe.for_job(core, ptj, watch_events=False).check(0.0)
    assert core.calls[-1] == ("pods", NS, f"training.kubeflow.org/job-name={JOB}")


# ------------------------------------------------------------------------------- wait / launch


class StaticProbe:
    def __init__(self, pods=(), events=()):
        self.inner = dg.JobProbe(lambda: list(pods), lambda: list(events), schedule_grace_s=600)
        self.closed = False

    def check(self, now):
        return self.inner.check(now)

    def close(self):
        self.closed = True


def _job():
    return trainjob.build_trainjob(
        spec(name=JOB, namespace=NS, gpus_per_node=0, cpu="", memory="", tolerations=[])
    )


@pytest.mark.parametrize("blocker,kind", [(dict(events=[event("podsecurity")]), "PodSecurity"),
                                          (dict(events=[event("quota")]), "exceeded quota"),
                                          (dict(pods=[pod("oom")]), "OOMKilled"),
                                          (dict(pods=[pod("evicted")]), "Evicted")])
def test_launch_ends_in_one_line_and_deletes_the_job(blocker, kind):
    api = FakeApi(statuses=[{}] * 50)
    probe = StaticProbe(**blocker)
    t = iter(range(0, 100_000, 20))
    with pytest.raises(jobspec.JobBlockedError) as e:
        launcher.launch(api, _job(), timeout_s=48 * 3600, poll_s=20, probe_factory=lambda created: probe,
                  clock=lambda: float(next(t)), **NO_SLEEP)
    msg = str(e.value)
    assert kind in msg and "fix:" in msg and msg.endswith("(job deleted)") and "\n" not in msg
    assert ("delete", JOB, "Background") in api.calls and not api.objects and probe.closed
    assert sum(c[0] == "get" for c in api.calls) == 1  # the first poll already ends it


def test_unschedulable_ends_after_the_grace_period_not_the_deadline():
    api = FakeApi(statuses=[{}] * 1000)
    now = [0.0]

    def sleep(s):
        now[0] += s

    with pytest.raises(jobspec.JobBlockedError, match="cannot be scheduled"):
        launcher.launch(api, _job(), timeout_s=48 * 3600, poll_s=20,
                  probe_factory=lambda c: StaticProbe([pod("unschedulable")]), clock=lambda: now[0],
                  sleep=sleep)
    assert 600 <= now[0] <= 620  # the grace period (10 min here), not the 48 h deadline
    assert sum(c[0] == "get" for c in api.calls) == 600 / 20 + 1


def test_keep_failed_keeps_the_job_and_says_how_to_delete_it():
    api = FakeApi(statuses=[{}] * 5)
    with pytest.raises(jobspec.JobBlockedError, match="job kept") as e:
        launcher.launch(api, _job(), timeout_s=3600, keep_failed=True,
                  probe_factory=lambda c: StaticProbe(events=[event("podsecurity")]), **NO_SLEEP)
    assert f"kubectl -n {NS} delete trainjob {JOB}" in str(e.value)
    assert not any(c[0] == "delete" for c in api.calls) and len(api.objects) == 1


def test_a_healthy_job_is_not_disturbed_and_suspended_jobs_are_not_probed():
    checks = []

    class Counting(StaticProbe):
        def check(self, now):
            checks.append(now)
            return super().check(now)

    api = FakeApi(statuses=[cond("Suspended", "Suspended"), RUNNING_V2, RUNNING_V2, cond("Complete")])
    final = launcher.launch(api, _job(), timeout_s=3600, probe_factory=lambda c: Counting([pod("running")]),
                      **NO_SLEEP)
    assert launcher.job_state(final)[0] == "Succeeded" and len(checks) == 2


def test_probe_errors_never_fail_a_running_job():
    class Broken:
        def check(self, now):
            raise RuntimeError("connection reset")

    api = FakeApi(statuses=[RUNNING_V2, cond("Complete")])
    final = launcher.launch(api, _job(), timeout_s=60, probe_factory=lambda c: Broken(), **NO_SLEEP)
    assert launcher.job_state(final)[0] == "Succeeded"


# ------------------------------------------------------------------------------------ tolerations


def test_the_merge_model_replaces_atomic_lists():
    """The model itself: a patch's tolerations replace the base's (what made the old launcher drop
    the GPU toleration), volumes merge by name."""
    base = {"spec": {"tolerations": [{"key": "a"}], "volumes": [{"name": "x", "emptyDir": {}}]}}
    patch = {"spec": {"tolerations": [{"key": "b"}], "volumes": [{"name": "y", "emptyDir": {}}]}}
    out = strategic_merge(base, patch, MERGE_KEYS)
    assert out["spec"]["tolerations"] == [{"key": "b"}]
    assert [v["name"] for v in out["spec"]["volumes"]] == ["x", "y"]


def test_extra_tolerations_are_added_to_the_runtimes_never_replace_them():
    runtime = prod_runtime()
    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    extra = {"key": "team", "operator": "Equal", "value": "vision", "effect": "NoSchedule"}
    rt_tol = trainjob.runtime_pod_spec(runtime)["tolerations"]
    assert gpu in rt_tol
    s = spec(gpus_per_node=0, cpu="", memory="", tolerations=[extra, gpu])  # gpu: already the runtime's
    assert trainjob.needs_runtime(s)
    with pytest.raises(ValueError, match="tolerations need the runtime"):
        trainjob.build_trainjob(s)
    job = trainjob.build_trainjob(s, runtime)
    tols = effective_trainer_pod(runtime, job)["spec"]["tolerations"]
    assert tols == [*rt_tol, extra]  # the runtime's first, each once, then the extra one
    from tests import k8s_schemas

    k8s_schemas.check(job)


def test_the_old_patch_would_have_dropped_the_gpu_toleration():
    """What a patch with only the extra toleration does under Trainer's merge (the bug)."""
    runtime = prod_runtime()
    extra = {"key": "team", "operator": "Equal", "value": "vision", "effect": "NoSchedule"}
    job = trainjob.build_trainjob(spec(gpus_per_node=0, cpu="", memory="", tolerations=[extra]), runtime)
    rj = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    rj["template"]["spec"]["template"]["spec"]["tolerations"] = [extra]
    tols = effective_trainer_pod(runtime, job)["spec"]["tolerations"]
    assert not any(t.get("key") == "nvidia.com/gpu" for t in tols)


def test_no_extra_tolerations_no_runtime_read_and_no_toleration_patch():
    s = spec(gpus_per_node=0, cpu="", memory="", tolerations=[])
    assert not trainjob.needs_runtime(s)
    job = trainjob.build_trainjob(s)
    rj = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert "tolerations" not in rj["template"]["spec"]["template"].get("spec", {})
    runtime = prod_runtime()
    tols = effective_trainer_pod(runtime, job)["spec"]["tolerations"]
    assert tols == trainjob.runtime_pod_spec(runtime)["tolerations"]


def test_quantities_use_the_kubernetes_parser():
    assert (
        jobspec.quantity("1600Gi") == 1600 * 2**30
        and jobspec.quantity("500m") * 2 == 1
        and jobspec.quantity(8) == 8
    )
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        jobspec.quantity("lots")


def test_timestamps():
    utc = datetime.timezone.utc
    assert dg._when("2026-11-25T13:05:09Z") == datetime.datetime(2026, 11, 25, 13, 5, 9, tzinfo=utc)
    assert dg._when("2026-11-25T13:05:09.123456Z").microsecond == 123456


# ------------------------------------------------------------------------- kubeflow SDK (logs)


class _FakeTrainerAPI:
    """A fake Kubernetes API over HTTP with what `kubeflow.trainer.TrainerClient.get_job_logs` reads:
    the TrainJob, its runtime (namespaced 404 -> cluster-scoped), the JobSet's pods, the pod log."""

    def __init__(self, trainjob: dict, runtime: dict, pods: list[dict], log_text: str):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        routes = {
            f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS}/trainjobs/{JOB}": trainjob,
            "/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes/chunkgrpo-torch": runtime,
            f"/api/v1/namespaces/{NS}/pods": {"apiVersion": "v1", "kind": "PodList", "metadata": {},
                                              "items": pods},
        }
        self.paths = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                path = self.path.partition("?")[0]
                outer.paths.append(self.path)
                if path.endswith("/log"):
                    body, ctype, code = log_text.encode(), "text/plain", 200
                elif path in routes:
                    body, ctype, code = json.dumps(routes[path]).encode(), "application/json", 200
                else:
                    body, ctype = b'{"kind":"Status","code":404,"reason":"NotFound"}', "application/json"
                    code = 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.host = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_log_tail_through_the_kubeflow_sdk_trainer_client():
    """The real TrainerClient (kubeflow 0.5) against a fake API: node 0's pod found by its JobSet
    labels, its log read, the tail returned; a PyTorchJob or an unreachable API gives []."""
    from kubeflow.trainer import KubernetesBackendConfig, TrainerClient
    from kubernetes.client import Configuration

    job_obj = {**_job(), "metadata": {**_job()["metadata"], "creationTimestamp": "2026-11-25T13:05:00Z"}}
    node0 = pod("oom")
    node0["metadata"]["labels"].update({"jobset.sigs.k8s.io/replicatedjob-name": "node",
                                        "batch.kubernetes.io/job-completion-index": "0"})
    node0["metadata"]["creationTimestamp"] = "2026-11-25T13:05:09Z"
    log_text = "\n".join(f"iteration {i}: reward 0.{i}" for i in range(100))
    log_text += "\ntorch.OutOfMemoryError: boom\n"
    api = _FakeTrainerAPI(job_obj, prod_runtime(), [node0], log_text)
    try:
        cfg = Configuration(host=api.host)
        client = TrainerClient(KubernetesBackendConfig(namespace=NS, client_configuration=cfg))
        tail = trainjob.trainjob_log_tail(job_obj, lines=5, client=client)
        assert tail[-1] == "torch.OutOfMemoryError: boom" and tail[0] == "iteration 96: reward 0.96"
        assert len(tail) == 5
        assert any(p.startswith(f"/api/v1/namespaces/{NS}/pods?") and "jobset-name" in p for p in api.paths)
        log_path = f"/api/v1/namespaces/{NS}/pods/{node0['metadata']['name']}/log"
        assert any(p.startswith(log_path) for p in api.paths)
        assert trainjob.trainjob_log_tail({**job_obj, "kind": "PyTorchJob"}, client=client) == []
    finally:
        api.close()

    class Unreachable:
        def get_job_logs(self, name):
            raise RuntimeError(f"Failed to get TrainJob: {NS}/{name}")  # what the SDK raises

    assert trainjob.trainjob_log_tail(job_obj, client=Unreachable()) == []  # a warning, not an error


def test_a_failed_job_prints_its_log_tail_before_the_one_line_error():
    api = FakeApi(statuses=[RUNNING_V2, cond("Failed", "BackoffLimitExceeded", "node-0 exited 1")])
    seen = []
    with pytest.raises(jobspec.JobFailedError, match="BackoffLimitExceeded") as e:
        launcher.launch(api, _job(), timeout_s=60, on_status=seen.append,
                  logs=lambda o: ["step 3", "Traceback: boom"], **NO_SLEEP)
    assert "\n" not in str(e.value)
    assert seen[-3:] == [f"last 2 log lines of {JOB} node 0:", "  | step 3", "  | Traceback: boom"]


def test_a_crash_looping_container_is_one_line_with_its_last_exit():
    (f,) = dg.pod_findings(pod("crashloop"))
    assert f.kind == "CrashLoop" and f.grace_s == 0
    assert "container node is crash-looping (3 restarts, CrashLoopBackOff)" in f.cause
    assert "exit code 1 (Error): chunkgrpo.errors.UserError: scorer 'hpsv3' needs the hpsv3 package" \
        in f.cause
    assert "\n" not in f.line()
    rising = pod("running")
    rising["status"]["containerStatuses"][0]["restartCount"] = dg.CRASH_RESTARTS
    rising["status"]["containerStatuses"][0]["lastState"] = {"terminated": {"exitCode": 1, "reason": "Error"}}
    (r,) = dg.pod_findings(rising)  # running again, but restarted in place twice already
    assert r.kind == "CrashLoop" and "exit code 1 (Error)" in r.cause
    once = pod("running")
    once["status"]["containerStatuses"][0]["restartCount"] = 1
    assert dg.pod_findings(once) == []  # one restart (a transient failure) is not a loop
    assert [x.kind for x in dg.pod_findings(pod("oom"))] == ["OOMKilled"]  # an OOM loop says OOM


def test_failed_pods_of_a_job_that_never_restarts_in_place_are_a_crash_loop():
    failed = []
    for i in range(dg.CRASH_RESTARTS):
        p = pod("crashloop")
        p["metadata"]["name"] = f"{JOB}-node-0-0-{i}"
        p["metadata"]["creationTimestamp"] = f"2026-11-25T13:0{i}:00Z"
        p["status"] = {"phase": "Failed", "containerStatuses": [{
            "name": "node", "restartCount": 0, "state": {"terminated": {
                "exitCode": 2, "reason": "Error", "message": "chunkgrpo train: error: bad config"}}}]}
        failed.append(p)
    probe = dg.JobProbe(lambda: failed, list)
    f = probe.check(0.0)
    assert f is not None and f.kind == "CrashLoop" and f"the last {JOB}-node-0-0-1" in f.cause
    assert "exit code 2 (Error): chunkgrpo train: error: bad config" in f.cause
    assert dg.JobProbe(lambda: failed[:1], list).check(0.0) is None


def test_a_crash_loop_ends_the_step_at_the_first_poll_with_the_log_tail_and_deletes_the_job():
    """Minutes, not the Job's six back-offs: the first poll that sees the loop ends the step; the last log
    lines of node 0 are printed before the one-line error, then the job is deleted."""
    api = FakeApi(statuses=[RUNNING_V2] * 50)
    lines = []
    tail = ["Traceback (most recent call last):",
            "chunkgrpo.errors.UserError: scorer 'hpsv3' needs the hpsv3 package"]
    with pytest.raises(jobspec.JobBlockedError) as e:
        launcher.launch(api, _job(), timeout_s=48 * 3600, poll_s=20, on_status=lines.append,
                        probe_factory=lambda c: StaticProbe([pod("crashloop")]), logs=lambda obj: tail,
                        **NO_SLEEP)
    msg = str(e.value)
    assert "crash-looping" in msg and msg.endswith("(job deleted)") and "\n" not in msg
    assert lines[-3:] == [f"last 2 log lines of {JOB} node 0:", f"  | {tail[0]}", f"  | {tail[1]}"]
    assert ("delete", JOB, "Background") in api.calls and sum(c[0] == "get" for c in api.calls) == 1
