"""benchmarks/peers.py: the loops it compares make the transformer calls their docstring says, the two
policy updates give the same gradient, and a gradient mismatch fails the run."""

import json

import pytest

from tests import benchmark_scripts


@pytest.fixture(scope="module")
def peers():
    return benchmark_scripts.load("peers")


ARGS = ["--size", "tiny", "--res", "32", "--group", "3", "--steps", "5", "--reps", "1", "--warmup", "0",
        "--policy-batch", "4"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_calls_per_loop_and_equal_gradients(peers, tmp_path, capsys, precision):
    out = tmp_path / "peers.json"
    assert peers.main([*ARGS, "--json", str(out), f"mixed_precision={precision}"]) == 0
    r = json.loads(out.read_text())
    assert r["bf16_autocast"] is (precision == "bf16")
    # the layouts round differently: fp32 agrees to ~1e-7, bf16 autocast to ~1e-3 (unit roundoff 3.9e-3)
    assert r["grad_tol"] == (3e-2 if precision == "bf16" else 1e-4)
    assert 0 <= r["grad_max_rel_diff"] < r["grad_tol"] and r["grad_max_abs"] > 0
    G, N = 3, 5
    ro = r["rollout"]
    # engine: the group in one batch, step 0 once; Flow-GRPO: one batch, step 0 G times; DanceGRPO: batch 1
    assert (ro["engine"]["calls"], ro["engine"]["sample_evals"]) == (N, 1 + (N - 1) * G)
    assert (ro["flow_grpo"]["calls"], ro["flow_grpo"]["sample_evals"]) == (N, N * G)
    assert (ro["dance_grpo"]["calls"], ro["dance_grpo"]["sample_evals"]) == (G * N, G * N)
    pairs = sum(r["trained_steps_per_sample"])
    po = r["policy"]
    assert po["dance_grpo"]["calls"] == po["dance_grpo"]["sample_evals"] == pairs  # one forward per pair
    assert po["engine"]["calls"] < pairs  # batched up to policy_batch
    assert po["engine"]["sample_evals"] <= pairs
    assert set(r["ratios"]) == {"rollout_engine_vs_flow_grpo", "rollout_engine_vs_dance_grpo",
                                "policy_engine_vs_dance_grpo"}
    printed = capsys.readouterr().out
    assert "policy_engine_vs_dance_grpo" in printed and "gradients:" in printed


def test_a_gradient_mismatch_fails_the_run(peers, monkeypatch, capsys):
    """The engine's window with a wrong scale (2×) must be caught by the gradient comparison."""
    from chunkgrpo.train import policy_window

    real = policy_window.window_backward

    def doubled(units, *a, **k):
        for u in units:
            u.scale *= 2
        return real(units, *a, **k)

    monkeypatch.setattr(policy_window, "window_backward", doubled)
    assert peers.main(ARGS) == 1
    assert "gradients differ" in capsys.readouterr().err


def test_bad_arguments_name_the_value(peers, capsys):
    with pytest.raises(SystemExit) as e:
        peers.main(["--group", "0"])
    assert e.value.code == 2
    assert "--group must be >= 1, got 0" in capsys.readouterr().err
