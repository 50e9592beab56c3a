"""LoRA adapters (Hu 2021, "LoRA: Low-Rank Adaptation of Large Language Models") on any transformers model,
with ``peft``.

``apply_lora(model, rank=8)`` injects LoRA layers into ``model`` in place (``peft.get_peft_model(...)
.get_base_model()``): each targeted weight ``W`` computes ``W x + (alpha / r) B A x`` with trainable ``A``
[r, in] (random) and ``B`` [out, r] (zeros, so the adapted model starts equal to the base), and every other
parameter is frozen (``requires_grad=False``). The model keeps its own class (``LlamaForCausalLM``, ...):
``generate``, the critic and ILQL heads, FSDP2's ``shard`` and the checkpoints take it as they take the
plain model; the peft wrapper object is not kept.

- ``adapters_disabled(model)``: inside, the model is the base model (the reference policy of the KL terms,
  with no second copy of the weights), as ``PeftModel.disable_adapter()``;
- ``merge_lora(model)``: fold ``(alpha / r) B A`` into ``W`` and put the plain layers back (as
  ``PeftModel.merge_and_unload()``): the result saves as an ordinary HF folder;
- ``is_lora(model)``: whether ``model`` holds LoRA layers;
- ``share_frozen_parameters(model, source)``: two adapted copies of one base hold its frozen weights once.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence

import torch
from torch import nn

DEFAULT_TARGETS = "all-linear"
"""peft's name for every ``nn.Linear`` / GPT-2 ``Conv1D`` except the output layer: the attention and MLP
projections of GPT-2 (``c_attn``, ``c_proj``, ``c_fc``), Llama/Qwen2 (``q_proj`` ... ``down_proj``)."""


def _conv1d_type() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - every supported transformers has it
        return None
    return Conv1D


def _linear_names(model: nn.Module) -> list[str]:
    """Leaf names of the linear layers (``nn.Linear`` and GPT-2's ``Conv1D``) of ``model``, sorted."""
    kinds = tuple(t for t in (nn.Linear, _conv1d_type()) if t is not None)
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, kinds)})


def is_lora(model: nn.Module) -> bool:
    """True if ``model`` holds peft LoRA layers (``apply_lora``)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in model.modules())


def apply_lora(
    model: nn.Module,
    *,
    rank: int,
    alpha: float | None = None,
    dropout: float = 0.0,
    target_modules: Sequence[str] | str | None = None,
    seed: int | None = 0,
) -> nn.Module:
    """Inject LoRA layers into ``model`` in place and freeze everything else; returns ``model``.

    GPT-2's attention and MLP layers are ``transformers.Conv1D`` (weights stored [in, out]): peft's
    ``fan_in_fan_out`` is set for them, so the adapter and its merge use the transposed layout.

    Args:
        model: a transformers model (a causal LM, or a backbone such as the critic's ``GPT2Model``).
        rank: r, the adapters' rank (>= 1).
        alpha: the adapters' scale is ``alpha / rank``; None = ``2 * rank`` (scale 2 at every rank, the
            usual r = 8 / alpha = 16 pair).
        dropout: dropout on the adapters' input (training mode only) in [0, 1).
        target_modules: module names (a name, or the last part of a dotted path, as peft matches them), a
            regex string, or None for ``"all-linear"`` (every linear layer except the output layer).
        seed: seeds the ``A`` init (None draws from the global RNG); every rank of a sharded run must build
            the same adapters.

    Returns:
        ``model`` with LoRA layers; only the adapters' ``A`` and ``B`` require grad.

    Raises:
        ValueError: ``rank < 1``, ``alpha <= 0``, ``dropout`` outside [0, 1), ``model`` already holds LoRA
            layers, or no module matches ``target_modules`` (the message lists the linear layers there are).
    """
    from peft import LoraConfig, get_peft_model

    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an int >= 1, got {rank!r}")
    if alpha is not None and not alpha > 0:
        raise ValueError(f"alpha must be > 0 or None (2 * rank), got {alpha}")
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if is_lora(model):
        raise ValueError(f"{type(model).__name__} already holds LoRA layers; apply_lora once per model")
    targets = DEFAULT_TARGETS if target_modules is None else target_modules
    targets = targets if isinstance(targets, str) else list(targets)
    conv1d = _conv1d_type()
    # fan_in_fan_out when the targeted layers are Conv1D (GPT-2): peft would otherwise fix it per layer, warning
    fan_in_fan_out = conv1d is not None and any(isinstance(m, conv1d) for m in model.modules())
    config = LoraConfig(
        r=rank, lora_alpha=float(alpha if alpha is not None else 2 * rank), lora_dropout=dropout,
        target_modules=targets, fan_in_fan_out=fan_in_fan_out, bias="none",
    )
    try:
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            if seed is not None:
                torch.manual_seed(seed)
            wrapped = get_peft_model(model, config)
    except ValueError as e:
        raise ValueError(
            f"lora target_modules {target_modules!r} match no layer of {type(model).__name__} ({e}); its linear "
            f"layers are {_linear_names(model)}"
        ) from e
    return wrapped.get_base_model()


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block ``model`` computes its base model (every LoRA layer returns ``W x``), as peft's
    ``PeftModel.disable_adapter()``; the adapters are enabled again on exit, also after an error. A no-op for
    a model without LoRA layers. Yields ``model``."""
    layers = [m for m in _lora_layers(model) if not m.disable_adapters]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (``W + (alpha / r) B A``) and put the plain layer back in its
    place, in place (peft's ``merge_and_unload``); returns ``model``, now without LoRA layers or
    ``peft_config``, so ``save_pretrained`` writes an ordinary HF folder. Copy first (``copy.deepcopy``) to
    keep the adapted model."""
    layers = set(_lora_layers(model))
    names = [name for name, m in model.named_modules() if m in layers]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = getattr(parent, child)
        layer.merge(safe_merge=True)
        setattr(parent, child, layer.get_base_layer())
    for m in model.modules():
        if "peft_config" in m.__dict__:
            del m.peft_config
    return model


def share_frozen_parameters(model: nn.Module, source: nn.Module) -> int:
    """Make every frozen parameter of ``model`` the very parameter of the same name in ``source``, where that
    one is frozen too and holds equal values (same shape, dtype and device); in place. For two adapted copies
    of one base (the policy's and the PPO critic's backbone): their frozen base weights then exist once.

    Sharded (FSDP2) models must not share: call it before ``shard``, at world size 1.

    Returns:
        The number of parameter elements ``model`` no longer holds itself.
    """
    theirs = dict(source.named_parameters(remove_duplicate=False))
    shared: dict[int, int] = {}  # id -> numel: a tied parameter (embedding = output layer) counts once
    for name, mine in list(model.named_parameters(remove_duplicate=False)):
        other = theirs.get(name)
        if other is None or other is mine or mine.requires_grad or other.requires_grad:
            continue
        if (mine.shape, mine.dtype, mine.device) != (
            other.shape,
            other.dtype,
            other.device,
        ) or not torch.equal(mine, other):
            continue
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, attr, other)
        shared[id(mine)] = mine.numel()
    return sum(shared.values())


__all__ = [
    "DEFAULT_TARGETS",
    "adapters_disabled",
    "apply_lora",
    "is_lora",
    "merge_lora",
    "share_frozen_parameters",
]
