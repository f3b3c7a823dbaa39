"""benchmarks/eval_image_preflight.py: the eval lock without one package (its hash lines too)."""

from tests.benchmark_scripts import ROOT, load


def test_lock_without_drops_the_package_and_its_hashes_only(tmp_path):
    out = tmp_path / "locks" / "eval" / "requirements.lock"
    load("eval_image_preflight").lock_without("peft", ROOT / "images" / "eval" / "requirements.lock", out)
    full = (ROOT / "images" / "eval" / "requirements.lock").read_text().splitlines()
    kept = out.read_text().splitlines()
    assert any(line.startswith("peft==") for line in full)
    assert not any(line.startswith("peft==") for line in kept)
    gone = [line for line in full if line not in kept]
    assert gone[0].startswith("peft==") and all(line.startswith("    ") for line in gone[1:]), gone
    assert sum(1 for line in kept if "==" in line and not line.startswith(" ")) == sum(
        1 for line in full if "==" in line and not line.startswith(" ")) - 1
