"""This engine against its peers' loops, on one model and one set of trajectories: the rollout of a group
and the policy update over it (the ratios are printed so that a regression shows).

    python benchmarks/peers.py                                   # mid size, 128², G = 8, 16 steps
    python benchmarks/peers.py --size tiny --res 64 --reps 1     # seconds (the test runs this)
    python benchmarks/peers.py --size flux --res 512 --device cuda --preset chunk_grpo_flux lora.enabled=true

Rollout of one prompt's group (G samples, N steps, no grad; `FluxModel.counter` counts the calls):

* ``engine``: `rollout.rollout_group`: the group in one batch, the shared first step once
  (N transformer calls, 1 + (N − 1)·G sample-evaluations).
* ``flow_grpo``: Flow-GRPO's sampling loop: the group in one batch, each sample from its own initial
  noise, so step 0 too is evaluated G times (N calls, N·G sample-evaluations).
* ``dance_grpo``: DanceGRPO's sampling loop: one sample at a time (G·N calls of batch 1).

Policy update of one window over the engine's trajectories (all G samples, the same trained steps: the
config's `timestep_fraction` of the N − 1 trainable steps per sample, DanceGRPO's step-level objective):

* ``engine``: `policy_window.window_backward` as `train/grpo.py` calls it in the first window (θ = θ_old,
  ratio exactly 1): weighted passes of ≤ `policy_batch` distinct transformer inputs, a shared step-0
  input evaluated once.
* ``dance_grpo``: DanceGRPO's loop: for each sample, for each trained step, one forward of batch 1 with
  grad, the clipped surrogate against the rollout's log-prob, one backward.

The loops are timed in rounds (each loop once per round, `--reps` rounds after `--warmup`), so that a
slow spell of a shared machine falls on all of them alike; times are medians over the rounds, and a
ratio < 1 means the engine is faster. The two policy updates must give the same gradient (the same
objective; DanceGRPO's ratio is exp(logp − logp_rollout), 1 up to the layouts' rounding):
`max |g_engine − g_dance| / max |g|` is printed, and the run fails (exit 1) above `--grad-tol` (by
default 1e-4 in fp32, 3e-2 under bf16 autocast: `GRAD_TOL`).
Measured numbers: benchmarks/results/peers/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PROMPT = "a cat on a chair"
# the two policy updates batch differently, so their gradients agree to the arithmetic's rounding: fp32
# measured 2.5e-7 (tiny) and 4.6e-7 (mid) on the CPU; bf16 autocast (unit roundoff 2^-8 = 3.9e-3)
# 2.7e-3 (mid) and 5.3e-3 (FLUX.1-dev size) on an H200. A wrong weight or a missed term is O(1).
GRAD_TOL = {False: 1e-4, True: 3e-2}


def _rounds(loops: dict, reps: int, sync, warmup: int, counter) -> dict:
    """Each loop's median wall time over `reps` rounds (after `warmup` untimed rounds), a round calling
    every loop once in turn, so a slow spell of the machine falls on all of them alike; the transformer
    calls and sample-evaluations of one call (`counter`: the model's `CallCounter`); the last result."""
    for _ in range(warmup):
        for fn in loops.values():
            fn()
    rows = {name: {"reps_s": []} for name in loops}
    for _ in range(reps):
        for name, fn in loops.items():
            sync()
            counter.reset()
            t0 = time.perf_counter()
            out = fn()
            sync()
            rows[name]["reps_s"].append(round(time.perf_counter() - t0, 4))
            rows[name].update(calls=counter.forward, sample_evals=counter.samples, result=out)
    for row in rows.values():
        row["wall_s"] = statistics.median(row["reps_s"])
    return rows


def _grads(params):
    """The parameters' gradients as one fp32 vector (torch is imported late: `threads.configure` first)."""
    import torch

    return torch.cat([p.grad.detach().float().flatten() for p in params])


def run(args) -> dict:
    from chunkgrpo import threads as T

    T.configure()
    import torch

    from chunkgrpo.testing.tiny import build_tiny_flux
    from chunkgrpo.train.config import TrainConfig
    from chunkgrpo.train.trainer import Trainer

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        built = {}
        if args.size == "flux":  # FLUX.1-dev's transformer built on the device (flux_gpu.py's loader)
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from flux_gpu import full_transformer_config, install_loader

            model_dir = build_tiny_flux(tmp / "model", size="flux", layers=(1, 1))
            built = install_loader(full_transformer_config(model_dir, "flux"))
        else:
            model_dir = build_tiny_flux(tmp / "model", size=args.size)
        prompts = tmp / "prompts.txt"
        prompts.write_text(PROMPT + "\n")
        G, N = args.group, args.steps
        cfg = TrainConfig.load(args.preset, [
            f"model={model_dir}", f"prompts={prompts}", f"output_dir={tmp / 'run'}", "progress=false",
            "method=dance", "chunks=uniform:1", "distributed=ddp",
            "rewards=[{name: brightness, weight: 1.0}]",  # no reward model: the loops' cost alone
            f"sampling.num_steps={N}", f"sampling.height={args.res}",
            f"sampling.width={args.res}", f"group_size={G}", "prompts_per_rank=1", f"grad_accum={G}",
            f"policy_batch={args.policy_batch}", f"device={args.device}", "checkpoint.every=0",
            "checkpoint.resume=false", "tracking.image_every=0", *args.overrides,
        ])
        t = Trainer(cfg)
        t.setup()
        try:
            r = _measure(args, t, sync)
            r["transformer_params"] = built.get("params") or sum(
                p.numel() for p in t.model.transformer.parameters())
            return r
        finally:
            t.close()


def _measure(args, t, sync) -> dict:
    import torch

    from chunkgrpo import objectives as obj
    from chunkgrpo.rollout import pair_log_probs, rollout_group
    from chunkgrpo.train import policy_window

    cfg, model = t.cfg, t.model
    G, N, S = cfg.group_size, cfg.sampling.num_steps, cfg.trainable_steps
    cond = t.embeds.get([PROMPT])
    autocast = t._autocast
    samp = cfg.sampling

    # ------------------------------------------------------------------ rollout
    def engine():
        return rollout_group(model, cond, G, samp, torch.Generator().manual_seed(0))

    def flow_grpo():
        own_noise = replace(samp, same_noise=False)
        return rollout_group(model, cond, G, own_noise, torch.Generator().manual_seed(0))

    def dance_grpo():
        gen = torch.Generator().manual_seed(0)
        return [rollout_group(model, cond, 1, samp, gen) for _ in range(G)]

    model.transformer.eval()
    with torch.no_grad(), autocast():
        rollout = _rounds({"engine": engine, "flow_grpo": flow_grpo, "dance_grpo": dance_grpo},
                          args.reps, sync, args.warmup, model.counter)
    traj = rollout["engine"].pop("result")
    for row in rollout.values():
        row.pop("result", None)

    # ------------------------------------------------------------------ policy update, one window
    gen = torch.Generator().manual_seed(1)
    adv = torch.randn(G, generator=gen).to(t.info.device)  # values do not change the cost
    mask = obj.select_units(G, S, cfg.timestep_fraction, generator=gen)
    trained = [(b, mask[b].nonzero().flatten().tolist()) for b in range(G)]
    cond_rep = cond.repeat_interleave(G)
    params = t.trainable
    model.transformer.train()

    def forward(samples, steps):
        with autocast():
            return pair_log_probs(model, traj, cond_rep, samples, steps, samp)

    def zero():
        for p in params:
            p.grad = None

    def engine_update():
        zero()
        units = [policy_window.Unit(b, [s], adv[b], 1.0 / (G * len(ss))) for b, ss in trained for s in ss]
        policy_window.window_backward(units, forward, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                      strategy=cfg.chunk_backward, budget=cfg.policy_batch, params=params,
                                      key=traj.input_key)
        return _grads(params)

    def dance_update():
        zero()
        for b, ss in trained:
            for s in ss:
                logp = forward([b], [s])
                ratio = torch.exp(logp.float() - traj.log_probs[b, s].to(logp.device).float())
                loss = obj.clipped_surrogate(ratio, adv[b], cfg.clip_low, cfg.clip_high).sum()
                (loss / (G * len(ss))).backward()
        return _grads(params)

    policy = _rounds({"engine": engine_update, "dance_grpo": dance_update}, args.reps, sync, args.warmup,
                     model.counter)
    grads = {name: row.pop("result") for name, row in policy.items()}
    zero()
    scale = float(grads["dance_grpo"].abs().max())
    grad_rel = float((grads["engine"] - grads["dance_grpo"]).abs().max()) / max(scale, 1e-30)
    return {
        "size": args.size,
        "resolution": args.res,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "bf16_autocast": bool(t.bf16),
        "group_size": G,
        "num_steps": N,
        "trained_steps_per_sample": [len(ss) for _, ss in trained],
        "policy_batch": cfg.policy_batch,
        "preset": args.preset,
        "lora": cfg.lora.enabled,
        "lora_rank": cfg.lora.rank if cfg.lora.enabled else None,
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "text_tokens": cfg.sampling.max_sequence_length,
        "reps": args.reps,
        "warmup": args.warmup,
        "rollout": rollout,
        "policy": policy,
        "ratios": {
            f"{phase}_engine_vs_{peer}": round(rows["engine"]["wall_s"] / rows[peer]["wall_s"], 3)
            for phase, rows in (("rollout", rollout), ("policy", policy)) for peer in rows if peer != "engine"
        },
        "grad_max_rel_diff": grad_rel,
        "grad_max_abs": scale,
    }


def table(r: dict) -> str:
    lines = [f"{'phase':<8}{'loop':<12}{'wall s':>9}{'calls':>7}{'evals':>7}",
             "-" * 43]
    for phase in ("rollout", "policy"):
        for name, row in r[phase].items():
            lines.append(f"{phase:<8}{name:<12}{row['wall_s']:>9.3f}{row['calls']:>7}{row['sample_evals']:>7}")
    lines.append("")
    for k, v in r["ratios"].items():
        lines.append(f"{k}: {v:.3f}")
    lines.append(f"gradients: max |engine - dance_grpo| / max |g| = {r['grad_max_rel_diff']:.2e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny_cpu",
                    help="TrainConfig preset for the rest (LoRA, checkpointing, text length): tiny_cpu, or "
                         "chunk_grpo_flux with lora.enabled=true for the FLUX recipe's")
    ap.add_argument("--size", default="mid", choices=["tiny", "mid", "flux"], help="transformer size")
    ap.add_argument("--res", type=int, default=128, help="image height and width in pixels")
    ap.add_argument("--group", type=int, default=8, help="G, samples per prompt")
    ap.add_argument("--steps", type=int, default=16, help="N, sampling steps")
    ap.add_argument("--policy-batch", type=int, default=4, help="the engine's policy_batch")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds (each loop once per round)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (allocator, cuBLAS)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = chunkgrpo's thread policy)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--grad-tol", type=float, default=None,
                    help="largest allowed max |g_engine − g_dance| / max |g| (default: 1e-4 in fp32, "
                         "3e-2 under bf16 autocast)")
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("overrides", nargs="*", help="more TrainConfig overrides (e.g. lora.enabled=false)")
    args = ap.parse_args(argv)
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    for name in ("group", "steps", "policy_batch", "reps", "res"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads:
        os.environ["CHUNKGRPO_THREADS"] = str(args.threads)
    load = os.getloadavg()[0]
    r = run(args)
    r["load_before"] = round(load, 2)
    tol = args.grad_tol if args.grad_tol is not None else GRAD_TOL[r["bf16_autocast"]]
    r["grad_tol"] = tol
    print(table(r))
    print(json.dumps(r, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(r, indent=1) + "\n")
    if not r["grad_max_rel_diff"] <= tol:
        print(f"gradients differ: {r['grad_max_rel_diff']:.3e} > --grad-tol {tol}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
