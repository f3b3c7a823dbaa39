"""The CPU thread policy of every entry point, decided in one place.

    from chunkgrpo import threads
    threads.set_env_policy()           # an entry point, first: the OpenMP environment (before torch loads)
    threads.apply()                    # torch threads: min(cores available to this process, override)

Why: a torch process whose OpenMP threads busy-wait for work (libgomp's default `OMP_WAIT_POLICY`
spins ~300k iterations after every parallel region) steals the cores a second process needs; on a
shared machine two 2-thread jobs on 2 cores ran 4.2× slower (median, worst 13×) than alone, and the toy
pretraining fell 30–70× under a load of 5. Waiting passively (threads sleep at once) and never running
more threads than the cores this process may use (`os.sched_getaffinity`, i.e. the cgroup/cpuset or
`taskset` mask, not the machine's core count) keeps the slowdown near the fair share
(`benchmarks/contention.py` prints both policies).

The policy, in order:

* `OMP_WAIT_POLICY=PASSIVE` unless the user set `OMP_WAIT_POLICY`. libgomp reads it once, when it is
  loaded (`import torch`), so every entry point calls `set_env_policy` (or `configure`) before anything
  loads torch: `chunkgrpo.cli.main`, `python -m chunkgrpo`, `torchrun -m chunkgrpo.train` workers, the
  components' tasks (`components/_shared.py`), the scorer workers (their environment,
  `chunkgrpo.scoring.client.worker_env`), benchmarks and the tests' conftest. Importing `chunkgrpo`
  changes no environment variable: a program that imports the library keeps its own OpenMP settings.
* torch threads (`thread_count`) = the first of: the `threads` argument (> 0), `$CHUNKGRPO_THREADS`,
  `$OMP_NUM_THREADS` (torchrun sets 1 per worker), the cores available to the process — capped at
  the cores available, divided by `$LOCAL_WORLD_SIZE` under torchrun (the ranks of a node share its
  cores). 0 or unset means "all available cores". `configure` (called by the CLI before any command
  runs) applies it: `torch.set_num_threads` when torch is loaded, else `OMP_NUM_THREADS` in the
  environment when the count differs from torch's default, so torch starts with it.
* `CHUNKGRPO_THREAD_POLICY=spin` replaces passive waiting by a short bounded spin (`GOMP_SPINCOUNT`
  10000 iterations, `KMP_BLOCKTIME` 1 ms) with the same thread cap: passive waiting costs a process
  running alone the fork-join latency of every small parallel region (`benchmarks/contention.py`
  measures the three policies alone and contended; measured on 2 idle cores: a training step alone
  0.079 s with spin vs 0.147 s passive, but 3.1× slower beside a second 2-thread job (passive 0.66×),
  pretraining 4.4× (passive 1.55×): spin only for a machine the job has to itself).
* `CHUNKGRPO_THREAD_POLICY=legacy` switches both off (torch's defaults: spinning waits, threads =
  the machine's cores), for before/after measurements only.
"""

from __future__ import annotations

import os

ENV_THREADS = "CHUNKGRPO_THREADS"
ENV_POLICY = "CHUNKGRPO_THREAD_POLICY"
POLICIES = ("passive", "spin", "legacy")
SPIN_COUNT = "10000"  # `spin`: libgomp's busy-wait iterations after a parallel region (its default: 300k)


def policy(environ=None) -> str:
    """`passive` (default) or `legacy`; ValueError naming a bad $CHUNKGRPO_THREAD_POLICY."""
    env = environ if environ is not None else os.environ
    value = env.get(ENV_POLICY, "passive").strip().lower() or "passive"
    if value not in POLICIES:
        raise ValueError(f"{ENV_POLICY}={value!r} must be one of {', '.join(POLICIES)}")
    return value


def available_cores() -> int:
    """Cores this process may run on (affinity mask / cpuset), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def _env_int(environ, name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw.split(",")[0])  # OMP_NUM_THREADS may list nested levels: "2,1"
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be a whole number of threads") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} must be >= 0")
    return value


def thread_count(threads: int | None = None, environ=None) -> int:
    """The torch intra-op thread count the policy gives (see the module docstring for the order)."""
    environ = environ if environ is not None else os.environ
    cores = available_cores()
    if threads is not None and threads < 0:
        raise ValueError(f"threads={threads} must be >= 0 (0 = all available cores)")
    cap = max(1, cores // max(1, _env_int(environ, "LOCAL_WORLD_SIZE") or 1))
    for want in (threads, _env_int(environ, ENV_THREADS), _env_int(environ, "OMP_NUM_THREADS")):
        if want:
            return min(want, cap)
    return cap


def set_env_policy(environ=None) -> None:
    """Put the OpenMP wait policy into `environ` (default os.environ) unless the user chose one. Must
    run before torch is imported in this process to take effect here; child processes inherit it."""
    environ = environ if environ is not None else os.environ
    try:
        chosen = policy(environ)
    except ValueError:
        return  # reported by apply(), where a caller can turn it into a one-line error
    if chosen == "legacy":
        return
    if chosen == "spin":  # a short bounded spin: cheap fork-join alone, little stolen when shared
        environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
        environ.setdefault("KMP_BLOCKTIME", "1")
        return
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    environ.setdefault("KMP_BLOCKTIME", "0")  # the same for Intel's OpenMP runtime, if torch uses it


def apply(threads: int | None = None) -> int:
    """Set torch's intra-op threads by the policy (imports torch); returns the count. Under the legacy
    policy torch's own default is kept (unless `threads` > 0 asks for a number)."""
    import torch

    if policy() == "legacy":
        if threads:
            torch.set_num_threads(threads)
        return torch.get_num_threads()
    n = thread_count(threads)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def configure() -> int:
    """The policy for this process, without importing torch: the OpenMP environment, then torch's
    thread count (`torch.set_num_threads` when torch is already loaded; otherwise `OMP_NUM_THREADS`
    when the count differs from torch's default, the available cores). ValueError on a bad setting."""
    import sys

    set_env_policy()
    if policy() == "legacy":
        return 0
    n = thread_count()
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)
    elif n != available_cores() or ENV_THREADS in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(n)
    return n


def describe() -> str:
    """One line for logs and benchmark output."""
    import torch

    return (f"threads policy={policy()} torch_threads={torch.get_num_threads()} "
            f"cores_available={available_cores()} "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}")
