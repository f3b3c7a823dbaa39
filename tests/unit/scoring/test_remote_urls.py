"""A reward with a `url` in the train config: validated at load, recorded only when set."""

import pytest

from chunkgrpo.cli import main
from chunkgrpo.errors import UserError
from chunkgrpo.scoring.remote import RemoteReward
from chunkgrpo.scoring.rewards import get_reward
from chunkgrpo.train.checkpoint_policy import resume_config
from chunkgrpo.train.config import TrainConfig


def test_local_reward_record_is_unchanged_and_a_url_is_kept():
    cfg = TrainConfig.load("tiny_cpu", [])
    assert resume_config(cfg)["rewards"] == [{"name": "brightness", "weight": 1.0, "options": {}}]
    served = TrainConfig.load("tiny_cpu", ["rewards=[{name: hpsv3, url: 'http://reward:8080/'}]"])
    assert resume_config(served)["rewards"] == [
        {"name": "hpsv3", "weight": 1.0, "options": {}, "url": "http://reward:8080"}]


@pytest.mark.parametrize("url,match", [("reward:8080", "must look like http://host:port"),
                                       ("http://reward:port", "has a bad port"),
                                       ("ftp://reward", "must look like http://host:port")])
def test_bad_url_is_refused_at_load(url, match):
    with pytest.raises(UserError, match=match):
        TrainConfig.load("tiny_cpu", [f"rewards=[{{name: hpsv3, url: '{url}'}}]"])


def test_url_skips_the_local_name_check_and_builds_a_client():
    # the server resolves the name: one not installed here is fine
    TrainConfig.load("tiny_cpu", ["rewards=[{name: 'theirs.rewards:ocr', url: 'http://r:1'}]"])
    fn = get_reward("hpsv3", {"max_batch": "4", "deadline_s": 5}, url="http://r:1")
    assert isinstance(fn, RemoteReward) and fn.max_batch == 4 and fn.deadline_s == 5.0
    with pytest.raises(UserError, match=r"reward 'hpsv3' at http://r:1: bad client options "
                                        r"\{'weights': 'x'\}"):
        get_reward("hpsv3", {"weights": "x"}, url="http://r:1")
    with pytest.raises(UserError, match="max_batch >= 1"):
        get_reward("hpsv3", {"max_batch": 0}, url="http://r:1")


@pytest.mark.parametrize("argv,match", [
    (["--scorer", "brightnes"], "unknown reward 'brightnes' (did you mean 'brightness'?)"),
    (["--scorer", "brightness", "--host", "0.0.0.0", "--port", "0"],
     "--host 0.0.0.0 without $CHUNKGRPO_REWARD_TOKEN"),
    (["--scorer", "brightness", "--max-batch", "0"], "--max-batch=0"),
])
def test_reward_server_bad_input_is_one_line(argv, match, capsys, monkeypatch):
    monkeypatch.delenv("CHUNKGRPO_REWARD_TOKEN", raising=False)
    assert main(["reward-server", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("chunkgrpo reward-server: error: "), err
    assert match in err, err
