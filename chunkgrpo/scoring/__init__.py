"""The scoring layer: every reward and scorer by name, and how a score is computed, for `train/` and `eval/`.

- `table`    - every name `rewards:` (train) and `scorers:` (eval) accept: programmatic rewards by
               "module:attr", model scorers with their aliases and reward packages. Start here.
- `rewards`  - the programmatic rewards and `get_reward(name, options)` (training's entry point).
- `scorers`  - `get_scorer(name, weights=...)`: HPSv3, ImageReward, HPSv2(.1), PickScore, CLIP behind one
               batch API, in-process or in a worker process in the reward package's own venv.
- `custom`   - a user's reward or scorer: an import path `module:attr` or an entry point (groups
               `chunkgrpo.rewards`, `chunkgrpo.scorers`), resolved at config load, every answer checked.
- `adapters` - `ScorerReward` (a scorer as a training reward), `RewardScorer` (a reward as an eval scorer).
- `service`, `remote` - a reward served over HTTP (`chunkgrpo reward-server`) and the training client of
               `rewards: [{name: ..., url: ...}]` (batches, retries within a deadline, checks every answer).
- `weights`  - scorer weights from a local path or `s3://` through the store's download cache.
- `backends`, `worker`, `client` - the per-package model loaders, the worker process that runs them in
               a reward venv (stdlib + numpy + PIL at import: staged there, chunkgrpo is not installed),
               and the parent side that starts and talks to it.

Imports only layers below it (config, errors, store); `train/` and `eval/` import it, never the reverse.
This `__init__` imports nothing: the worker's staged copy of the package must stay importable without
chunkgrpo's dependencies.
"""
