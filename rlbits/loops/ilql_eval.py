"""ILQL's evaluation: steered decoding (``SteeredPolicy``) scored as any policy is (``phases.evaluate_policy``),
and the ``logit_mask`` file it may decode under (``load_logit_mask``).

``rlbits.loops.ilql`` validates with ``steered_validate`` and re-exports every name here; ``rlbits eval`` of an
ILQL run calls ``evaluate_run``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDictBase

from rlbits.distributed.env import DistEnv
from rlbits.loops import phases
from rlbits.loops.config import RunConfig
from rlbits.loops.runtime import Setup, disable_dropout, load_policy_and_tokenizer, policy_path, setup
from rlbits.models.heads import ILQLModel
from rlbits.models.load import load_tokenizer
from rlbits.models.steered import SteeredPolicy

if TYPE_CHECKING:  # only for the annotation: ilql imports this module
    from rlbits.loops.ilql import ILQLConfig

LOGIT_MASK_KEY = "logit_mask"  # the tensor's name in a safetensors or torch file holding several


def load_logit_mask(path: str | Path) -> torch.Tensor:
    """The [V, V] bool ``logit_mask`` saved at ``path`` (the ``logit_mask`` config field): a ``.safetensors``
    file (``safetensors.torch.save_file({"logit_mask": mask}, path)``) or a torch file (``torch.save(mask,
    path)``, read with ``weights_only=True``), holding the tensor alone or under the key ``logit_mask``. Any
    dtype: nonzero is True (forbidden), as trlx's ``torch.where(mask)``.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not a safetensors or torch file, no single tensor or ``logit_mask`` key in it, or not square
            2-D.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"logit_mask file {str(path)!r} does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(path)
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a corrupt or foreign file: name it
        raise ValueError(f"logit_mask file {str(path)!r} is not a safetensors or torch tensor file: {e}") from e
    if isinstance(tensors, dict):
        if LOGIT_MASK_KEY in tensors or len(tensors) == 1:
            tensors = tensors.get(LOGIT_MASK_KEY, next(iter(tensors.values())))
    if not isinstance(tensors, torch.Tensor):
        raise ValueError(
            f"logit_mask file {str(path)!r} must hold one tensor or a tensor under the key {LOGIT_MASK_KEY!r}"
        )
    if tensors.dim() != 2 or tensors.shape[0] != tensors.shape[1]:
        raise ValueError(f"logit_mask in {str(path)!r} must be [V, V], got {tuple(tensors.shape)}")
    return tensors != 0



def steered_validate(
    model: ILQLModel, tokenizer: Any, cfg: RunConfig, *, beta: float, reward: Any = None,
    prompts: Sequence[str] | None = None, env: DistEnv | None = None, make_env: Any = None,
    logit_mask: torch.Tensor | None = None,
) -> tuple[dict[str, float], TensorDictBase]:
    """``phases.evaluate_policy`` of ``SteeredPolicy(model, beta, logit_mask)``: the mean reward of steered
    decoding on ``prompts`` (default the task's test split) with ``reward`` (default the task's), the same
    prompts and noise as the base model's validation. ``logit_mask``: a [V, V] bool tensor (True: token j not
    allowed after token i) or None. Returns ``(metrics, batch)``."""
    if reward is None or prompts is None:
        run = Setup.of(cfg)
        reward, make_env = run.reward(reward), run.make_env if make_env is None else make_env
        prompts = prompts if prompts is not None else run.prompts(tokenizer, None, "test")
    return phases.evaluate_policy(
        SteeredPolicy(model, beta, logit_mask), tokenizer, cfg, reward=reward, prompts=prompts, env=env, make_env=make_env
    )


def evaluate_betas(
    model: ILQLModel, tokenizer: Any, cfg: RunConfig, betas: Sequence[float], *, reward: Any = None,
    prompts: Sequence[str] | None = None, logit_mask: torch.Tensor | None = None,
) -> dict[float, dict[str, float]]:
    """``steered_validate`` at each beta (same prompts and noise, under ``logit_mask`` if given):
    ``{beta: metrics}``."""
    kw = dict(reward=reward, prompts=prompts, logit_mask=logit_mask)
    return {b: steered_validate(model, tokenizer, cfg, beta=b, **kw)[0] for b in betas}


def load_final(run_dir: str | Path, device: str | torch.device = "cpu") -> tuple[ILQLModel, Any]:
    """The trained ILQL model (LM and heads, dropout off) and tokenizer of ``RUN_DIR/final``."""
    folder = Path(run_dir) / "final"
    return disable_dropout(ILQLModel.from_pretrained(folder, device=device)), load_tokenizer(folder)


def evaluate_run(run_dir: str | Path, cfg: ILQLConfig) -> dict[str, dict[str, float]]:
    """``rlbits eval RUN_DIR`` of an ILQL run: the base model (unsteered) and the final model steered at
    ``cfg.beta`` (under ``cfg.logit_mask``, as the run validated), on the task's test prompts with the same
    noise. Returns ``{"base": metrics, "final": metrics}``."""
    env, run = setup(cfg), Setup.of(cfg)
    policy, tokenizer = load_policy_and_tokenizer(policy_path(cfg), env)
    kw = dict(reward=run.reward(None), prompts=run.prompts(tokenizer, None, "test"), make_env=run.make_env)
    base, _ = phases.evaluate_policy(policy, tokenizer, cfg, **kw)
    model, tokenizer = load_final(run_dir, env.device)
    mask = load_logit_mask(cfg.logit_mask) if cfg.logit_mask is not None else None
    final, _ = steered_validate(model, tokenizer, cfg, beta=cfg.beta, logit_mask=mask, **kw)
    return {"base": base, "final": final}


__all__ = ["LOGIT_MASK_KEY", "evaluate_betas", "evaluate_run", "load_final", "load_logit_mask", "steered_validate"]
