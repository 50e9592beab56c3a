"""Regenerate the PNGs of docs/viz.md from real (short) runs on the task base models.

    python docs/images/generate.py            # about 3 minutes on 2 CPU cores; writes docs/images/*.png

Runs go to a temporary folder. The base models come from ``$RLBITS_CACHE`` (built on first use).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import torch  # noqa: E402

import rlbits  # noqa: E402
from rlbits.loops.common import rollout, score_rollout  # noqa: E402
from rlbits.tasks import get_task  # noqa: E402
from rlbits.viz import Dashboard, plot_compare, plot_run, plot_tokens  # noqa: E402

OUT = Path(__file__).resolve().parent
CONFIGS = Path(rlbits.__file__).resolve().parents[1] / "configs"


def main() -> None:
    torch.set_num_threads(1)
    runs = Path(tempfile.mkdtemp(prefix="rlbits-doc-images-"))
    common = dict(progress=False, tensorboard=False, save_period=0)

    # plot_run: two PPO runs on sentiment overlaid (KL coefficient 0.05 vs 0.2), and the live dashboard fed
    # by the first one.
    dash = Dashboard()
    ppo = {}
    for kl_coef in (0.05, 0.2):
        ppo[f"kl_coef {kl_coef}"] = rlbits.train(
            config=None,
            callbacks=[dash] if kl_coef == 0.05 else [],
            run_dir=str(runs / f"ppo_kl{kl_coef}"),
            kl_coef=kl_coef,
            max_num_steps=20,
            val_period=5,
            **common,
        )
    plot_run(list(ppo.values()), OUT / "plot_run.png", labels=list(ppo))
    dash.redraw()
    dash.figure.savefig(OUT / "dashboard.png", dpi=100)

    # plot_compare: RLOO vs plain REINFORCE on arithmetic, two seeds each.
    groups: dict[str, list[Path]] = {}
    for baseline in ("none", "rloo"):
        for seed in (0, 1):
            run_dir = rlbits.train(
                config=CONFIGS / "rloo_arithmetic.yaml",
                baseline=baseline,
                seed=seed,
                run_dir=str(runs / f"{baseline}_s{seed}"),
                max_num_steps=10,
                num_prompts_per_step=16,
                val_period=2,
                max_val_samples=200,
                **common,
            )
            groups.setdefault(baseline, []).append(run_dir)
    fig = plot_compare(groups, "val_reward")
    fig.axes[0].set_ylabel("greedy test accuracy")
    fig.savefig(OUT / "plot_compare.png", dpi=110)

    # plot_tokens: the advantages of one response of the trained sentiment policy (PPO phases 1-5).
    from rlbits.loops import ppo as ppo_loop
    from rlbits.loops.api import resolve_config
    from rlbits.loops.common import setup

    cfg = resolve_config(None, {"run_dir": str(runs / "tokens")})
    env = setup(cfg)
    checkpoint = ppo["kl_coef 0.05"] / "checkpoints" / "step_20"  # the trained policy and critic
    policy, tokenizer = rlbits.load_pretrained(str(checkpoint / "policy"))
    critic = rlbits.ValueModel.from_pretrained(checkpoint / "value")
    reference, _ = rlbits.load_pretrained(rlbits.zoo.base_model("sentiment"))
    prompts = get_task("sentiment").prompts("test")[:8]
    batch = rollout(
        policy,
        tokenizer,
        prompts,
        max_new_tokens=24,
        temperature=1.0,
        generator=torch.Generator().manual_seed(0),
    )
    score_rollout(batch, get_task("sentiment").reward)
    ppo_loop.reference(reference, batch, cfg)
    ppo_loop.values(critic, batch, cfg)
    ppo_loop.advantages(batch, cfg, env, kl_coef=cfg.kl_coef)
    row = int(batch["action_mask"].sum(-1).argmax())
    plot_tokens(batch, "advantages", row=row, tokenizer=tokenizer).savefig(
        OUT / "plot_tokens.png", dpi=110, bbox_inches="tight"
    )
    kl = rlbits.kl_penalty(batch["logprobs"], batch["ref_logprobs"], "k3")
    plot_tokens(batch, kl, row=row, tokenizer=tokenizer, title="k3 KL to the reference per token").savefig(
        OUT / "plot_tokens_kl.png", dpi=110, bbox_inches="tight"
    )
    for name in ("plot_run", "dashboard", "plot_compare", "plot_tokens", "plot_tokens_kl"):
        print(OUT / f"{name}.png")


if __name__ == "__main__":
    main()
