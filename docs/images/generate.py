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
                adv_estimator=baseline,
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
    plot_token_figures(ppo["kl_coef 0.05"] / "checkpoints" / "step_20", runs / "tokens")
    for name in ("plot_run", "dashboard", "plot_compare", "plot_tokens", "plot_tokens_kl"):
        print(OUT / f"{name}.png")


def plot_token_figures(checkpoint: Path, run_dir: Path, out: Path = OUT, **overrides) -> None:
    """``plot_tokens.png`` and ``plot_tokens_kl.png``: PPO phases 1-5 (rollout, score, reference, values,
    advantages) on 8 test prompts with the policy and critic of a PPO ``checkpoint`` (weights in its ``dcp/``),
    the base model as the reference. ``overrides``: config values (the default main job's otherwise)."""
    from rlbits.distributed.checkpoint import load_checkpoint
    from rlbits.loops import ppo as ppo_loop
    from rlbits.loops.api import resolve_config
    from rlbits.loops.phases import prompt_batch
    from rlbits.loops.runtime import setup

    cfg = resolve_config(None, {"run_dir": str(run_dir), "kl_coef": 0.05, **overrides})  # the trained run's config
    env = setup(cfg)
    state = ppo_loop.init_state(cfg, env)  # policy, critic and reference from the initial weights
    load_checkpoint(checkpoint, models=state.models, env=env)  # the trained policy and critic
    state.sampling_generator = torch.Generator(env.device).manual_seed(0)
    batch = ppo_loop.rollout(state, prompt_batch(state.val_prompts[:8]), cfg)
    for phase in (ppo_loop.score, ppo_loop.reference, ppo_loop.values, ppo_loop.advantages):
        batch = phase(state, batch, cfg)
    row = int(batch["action_mask"].sum(-1).argmax())
    plot_tokens(batch, "advantages", row=row, tokenizer=state.tokenizer).savefig(
        out / "plot_tokens.png", dpi=110, bbox_inches="tight"
    )
    kl = rlbits.kl_penalty(batch["logprobs"], batch["ref_logprobs"], "k3")
    plot_tokens(batch, kl, row=row, tokenizer=state.tokenizer, title="k3 KL to the reference per token").savefig(
        out / "plot_tokens_kl.png", dpi=110, bbox_inches="tight"
    )


if __name__ == "__main__":
    main()
