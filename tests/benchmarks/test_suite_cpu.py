"""benchmarks/suite_cpu.py: processes are charged to the test their xdist worker ran at each reading, by
kind; a process outside the session is not counted."""

from tests.benchmark_scripts import load

LOG = [
    "S 10 100.0 tests/unit/test_a.py::t1",
    "E 10 110.0 tests/unit/test_a.py::t1",
    "S 10 111.0 tests/pipeline/test_b.py::t2",
    "E 10 130.0 tests/pipeline/test_b.py::t2",
]


def test_cpu_goes_to_the_test_the_workers_process_tree_ran_then():
    sc = load("suite_cpu")
    procs = {
        "10:1": {"cmd": "python -u -c import sys;exec(eval(sys.stdin.readline()))", "ppid": 5,
                 "s": [[100.5, 1.0], [105.0, 3.0], [120.0, 4.0]]},
        # a kfp.local task of the second test (a grandchild of the worker): 6 s from its first reading on
        "20:1": {"cmd": "python -m kfp.dsl.executor_main --component_module_path x", "ppid": 21,
                 "s": [[112.0, 2.0], [125.0, 6.0]]},
        "21:1": {"cmd": "sh -ec program_path=...", "ppid": 10, "s": [[112.0, 0.0]]},
        "30:1": {"cmd": "/usr/bin/some-daemon", "ppid": 1, "s": [[100.0, 50.0], [120.0, 60.0]]},
        "5:1": {"cmd": "python -m pytest -n 2", "ppid": 4, "s": [[100.0, 0.5]]},
    }
    by_kind, by_test, _ = sc.attribute(procs, LOG, root_pid=5)
    assert by_kind["kfp.local task"] == 6.0 and by_kind["xdist worker (in-process tests)"] == 4.0
    assert "other: /usr/bin/some-daemon" not in by_kind  # not under pytest
    assert by_test["tests/unit/test_a.py::t1"] == 3.0  # the worker's readings at 100.5 and 105
    assert by_test["tests/pipeline/test_b.py::t2"] == 1.0 + 6.0
    assert by_test["(pytest controller)"] == 0.5


def test_node_ids_of_junit_cases_and_kinds():
    sc = load("suite_cpu")
    assert sc.nodeid("tests.unit.test_a", "t1[x]") == "tests/unit/test_a.py::t1[x]"
    assert sc.nodeid("tests.unit.test_a.TestX", "t2") == "tests/unit/test_a.py::TestX::t2"
    uvicorn = "/v/bin/python -m uvicorn mlflow.server.fastapi_app:app"
    assert sc.kind(uvicorn) == "MLflow server (uvicorn worker)"
    assert sc.kind("/v/bin/python -m torch.distributed.run --nproc_per_node=2") == "torchrun agent"
