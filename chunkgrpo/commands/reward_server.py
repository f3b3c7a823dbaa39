"""Serve one reward or scorer over HTTP, for trainers whose config says `rewards: [{name: N, url: ...}]`.

    CHUNKGRPO_REWARD_TOKEN=... chunkgrpo reward-server --scorer hpsv3 --weights s3://models/hpsv3 \\
        --host 0.0.0.0 --port 8080 --device cuda

NAME is anything `rewards:` accepts: a built-in reward or scorer, `module:attr` or an entry point
(docs/rewards.md). Wire format, limits and metrics: `chunkgrpo.scoring.service` (POST /score, GET /healthz,
/readyz, /metrics). Without $CHUNKGRPO_REWARD_TOKEN the server listens on loopback addresses only. It
prints `listening on http://HOST:PORT` once bound (`--port 0` picks a free port), loads the reward, then
answers /readyz with 200.
"""

from __future__ import annotations

import argparse

NAME = "reward-server"
HELP = "serve a reward/scorer over HTTP (POST /score) for remote training rewards"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scorer", required=True, metavar="NAME", help="reward or scorer to serve")
    p.add_argument("--weights", default=None, metavar="URI", help="scorer weights: local dir or s3:// prefix")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a reward option (repeatable; the value parsed as YAML), e.g. --option target=0.8")
    p.add_argument("--device", default="cpu", help="device of a model scorer: cpu | cuda | cuda:N")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (non-loopback needs a token)")
    p.add_argument("--port", type=int, default=8080, help="port (0 = a free one, printed)")
    p.add_argument("--max-batch", type=int, default=64, help="most images in one request (more: 413)")
    p.add_argument("--max-request-bytes", type=int, default=64 << 20,
                   help="largest request body in bytes (larger: 413)")


def run(args: argparse.Namespace) -> int:
    import logging
    import os
    import signal
    import sys
    import threading

    from chunkgrpo.config import parse_override
    from chunkgrpo.errors import Terminated, UserError
    from chunkgrpo.scoring.custom import check_name
    from chunkgrpo.scoring.service import TOKEN_ENV, RewardService, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_name(args.scorer, "reward")  # an unknown name stops here, before the port is taken
    options = {}
    for text in args.option:
        key, value = parse_override(text)
        options[key] = value
    if args.weights:
        options["weights"] = args.weights
    if not 0 <= args.port < 65536:
        raise UserError(f"--port={args.port} must be in 0..65535")

    def build():
        from chunkgrpo.scoring.rewards import get_reward

        return get_reward(args.scorer, options, device=args.device)

    service = RewardService(args.scorer, build, max_batch=args.max_batch,
                            max_request_bytes=args.max_request_bytes, token=os.environ.get(TOKEN_ENV))
    server = serve(service, args.host, args.port)
    host, port = server.server_address[:2]
    print(f"listening on http://{host}:{port}", flush=True)
    stop, loading = threading.Event(), threading.Event()

    def on_sigterm(signum, _frame):
        """Serving: end the wait below. Loading (a download or a load that hangs): stop it where it is,
        so a pod being deleted goes at once, not after its grace period."""
        stop.set()
        if loading.is_set():
            raise Terminated(signum)

    loading.set()
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        service.load()
        loading.clear()
        print(f"ready: {args.scorer}", flush=True)
        stop.wait()
    except KeyboardInterrupt:
        pass
    except Terminated as e:
        print(f"chunkgrpo {NAME}: {e} while loading {args.scorer!r}; stopped", file=sys.stderr, flush=True)
        return 128 + e.signum
    finally:
        server.shutdown()
        close = getattr(service.fn, "close", None)
        if callable(close):
            close()
    return 0
