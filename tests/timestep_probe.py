"""Run by torchrun in tests/integration/test_timestep_dist.py (and in-process by
tests/unit/test_flux_time.py): set up the trainer exactly as training does (DDP or FSDP, bf16, LoRA or
full), then record the value the transformer's time and guidance embeddings receive for every timestep of
the schedule.

    torchrun --nproc_per_node=2 tests/timestep_probe.py OUT key=value ... [-- key=value ...] ...

Each `--`-separated group of TrainConfig overrides is one trainer, set up and probed in turn by the same
ranks (their process group kept between trainers, torn down after the last); group i's result goes to
`OUT.i.rank<r>`."""

import json
import sys

import torch


def probe(overrides: list[str]) -> dict:
    from chunkgrpo.train.config import TrainConfig
    from chunkgrpo.train.trainer import Trainer

    t = Trainer(TrainConfig.load("tiny_cpu", overrides))
    t.setup()
    tr, model, s = t.model.transformer, t.model, t.cfg.sampling
    seen: list[torch.Tensor] = []
    tr.time_text_embed.time_proj.register_forward_pre_hook(
        lambda mod, args: seen.append(args[0].detach().clone())
    )
    sig = s.sigmas(model.latent_shape(s.height, s.width)[0])
    ts = s.timesteps(sig)
    prompts = t.stream.batch(0, t.info.rank)
    cond = t.embeds.get(prompts)
    x = model.initial_noise(len(prompts), s.height, s.width, torch.Generator().manual_seed(0))
    ids = model.img_ids(s.height, s.width)
    rows = []
    with torch.no_grad():
        for i in range(s.num_steps):
            seen.clear()
            with t._autocast():
                model.velocity(x, ts[i].reshape(1), cond, ids, guidance=s.guidance)
            expect_t = (
                torch.tensor(float(ts[i]), dtype=torch.float64) / 1000
            ).float() * 1000  # fp32 arithmetic
            row = {"timestep": float(ts[i]), "seen": [float(v) for v in seen[0]], "dtype": str(seen[0].dtype),
                   "expect": float(expect_t), "exact": bool((seen[0] == expect_t).all())}
            if model.guidance_embeds:
                expect_g = torch.tensor(s.guidance, dtype=torch.float32) * 1000
                row.update(guidance_seen=[float(v) for v in seen[1]], guidance_dtype=str(seen[1].dtype),
                           guidance_exact=bool((seen[1] == expect_g).all()), guidance_expect=float(expect_g))
            rows.append(row)
    out = {"rank": t.info.rank, "world": t.info.world, "fsdp": t._is_fsdp(), "bf16": t.bf16,
           "base_dtype": str(model.dtype), "param_dtype_seen": str(next(tr.parameters()).dtype), "rows": rows}
    t.close()
    return out


def groups(args: list[str]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    for a in args:
        if a == "--":
            out.append([])
        else:
            out[-1].append(a)
    return out


if __name__ == "__main__":
    from chunkgrpo import startup
    from chunkgrpo.train import dist as D

    startup.fewer_full_collections()  # as the entry points: fewer full collections while it loads
    teardown, runs = D.teardown, groups(sys.argv[2:])
    for i, overrides in enumerate(runs):
        D.teardown = teardown if i == len(runs) - 1 else (lambda: None)  # one process group for all
        result = probe(overrides)
        with open(f"{sys.argv[1]}.{i}.rank{result['rank']}", "w") as f:
            json.dump(result, f)
