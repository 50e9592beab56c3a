"""Critic and ILQL heads on top of Hugging Face causal LMs.

- ``ValueModel``: the PPO critic, a transformer backbone (the causal LM without its LM head) and a scalar
  head giving V at every position.
- ``ILQLModel``: the ILQL model of Snell 2022 as laid out in trlx (``AutoModelForCausalLMWithILQLHeads``): a
  trainable causal LM whose LM head gives the policy logits, two Q heads over the vocabulary, their
  target copies, and a V head, all reading the last hidden state.

Both save as a Hugging Face folder plus the heads in a safetensors file and a small json, and load back
bit-exactly (the json records the attention implementation, which is reused on load).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModel, PreTrainedModel

from rlbits.models.load import atomic_folder, check_folder, check_safetensors, load_policy, read_json

VALUE_HEAD_WEIGHTS = "value_head.safetensors"
VALUE_HEAD_CONFIG = "value_head.json"
ILQL_HEADS_WEIGHTS = "ilql_heads.safetensors"
ILQL_HEADS_CONFIG = "ilql_heads.json"


def _backbone_of(policy: nn.Module, name: str = "policy") -> PreTrainedModel:
    base = getattr(policy, "base_model", None)
    if not isinstance(policy, PreTrainedModel) or base is None or base is policy:
        raise TypeError(
            f"{name} must be a transformers causal LM (e.g. GPT2LMHeadModel) whose base_model is the "
            f"backbone, got {type(policy).__name__}"
        )
    return base


def _attn(model: PreTrainedModel) -> str | None:
    return getattr(model.config, "_attn_implementation", None)


def _run_seeded(seed: int | None, fn):
    if seed is None:
        return fn()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fn()


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))


def _load_tensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ValueError(f"{what}: {str(path)!r} is missing")
    return load_file(str(path))


class ValueModel(nn.Module):
    """Critic: ``V(s_t)`` at every position of a token sequence.

    ``backbone`` is a transformer without LM head (``AutoModel``, e.g. ``GPT2Model``); ``head`` is
    ``nn.Linear(hidden, 1)``. The value at position t is that of the state after reading token t, i.e. before
    token t+1: for a batch ``cat(prompts, responses)`` the value of response token j is at position
    ``P - 1 + j`` (docs/design.md, ``values``).

    Head init: weights N(0, (1/(hidden+1))^2), bias 0. The last hidden state is normalised (entries of
    order 1), so initial values are near 0 and the first advantages are close to the returns; unlike a zero
    head, the non-zero weights pass a gradient to the backbone from the first step.

    Args:
        backbone: the base transformer; its ``forward`` returns ``last_hidden_state``.
        seed: seeds the head init (None draws from the global RNG).
    """

    def __init__(self, backbone: PreTrainedModel, *, seed: int | None = 0):
        super().__init__()
        if not isinstance(backbone, PreTrainedModel):
            raise TypeError(f"backbone must be a transformers PreTrainedModel, got {type(backbone).__name__}")
        self.backbone = backbone
        hidden = backbone.config.get_text_config().hidden_size

        def make():
            head = nn.Linear(hidden, 1)
            nn.init.normal_(head.weight, std=1.0 / (hidden + 1))
            nn.init.zeros_(head.bias)
            return head

        self.head = _run_seeded(seed, make)

    @property
    def config(self):
        return self.backbone.config

    @classmethod
    def from_policy(cls, policy: PreTrainedModel, *, seed: int | None = 0) -> ValueModel:
        """A critic whose backbone is a deep copy of ``policy``'s (the usual PPO init); shares no storage.

        Raises:
            TypeError: ``policy`` is not a transformers causal LM.
        """
        return cls(copy.deepcopy(_backbone_of(policy)), seed=seed).train(policy.training)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        attn_implementation: str | None = None,
        seed: int | None = 0,
    ) -> ValueModel:
        """Load a critic saved by ``save_pretrained``, or start one from a causal-LM folder.

        A folder with ``value_head.safetensors`` gives back the saved critic exactly. A plain causal-LM folder
        (e.g. the policy checkpoint) gives its backbone with a fresh head (``seed``).

        Args:
            dtype: backbone dtype (None: float32); the head keeps its saved dtype.
            attn_implementation: None reuses the one recorded at save time.

        Raises:
            CheckpointNotFoundError: folder or ``config.json`` missing.
            ValueError: ``value_head.json`` without the weights, weights of the wrong shape, or no safetensors
                weights (pickle files are not loaded).
        """
        p = check_folder(path, "value model")
        meta = read_json(p / VALUE_HEAD_CONFIG, "value model") if (p / VALUE_HEAD_CONFIG).exists() else None
        attn = attn_implementation or (meta or {}).get("attn_implementation")
        extra = {"attn_implementation": attn} if attn else {}
        config = AutoConfig.from_pretrained(p, local_files_only=True)
        check_safetensors(p, "value model")
        backbone = AutoModel.from_pretrained(
            p, config=config, dtype=dtype or torch.float32, use_safetensors=True, local_files_only=True, **extra
        )
        model = cls(backbone, seed=seed)
        if meta is not None:
            state = _load_tensors(p / VALUE_HEAD_WEIGHTS, "value model")
            expected = {k: tuple(v.shape) for k, v in model.head.state_dict().items()}
            got = {k: tuple(v.shape) for k, v in state.items()}
            if got != expected:
                raise ValueError(f"{VALUE_HEAD_WEIGHTS} in {str(path)!r} holds {got}; expected {expected}")
            model.head = model.head.to(next(iter(state.values())).dtype)
            model.head.load_state_dict(state)
        if device is not None:
            model = model.to(device)
        return model.eval()

    def save_pretrained(self, path: str | os.PathLike, tokenizer=None) -> Path:
        """Write the backbone in HF format (safetensors), ``value_head.safetensors`` and ``value_head.json``.

        Atomic (see ``rlbits.models.load.atomic_folder``). ``ValueModel.from_pretrained(path)`` loads it.
        """
        with atomic_folder(path) as tmp:
            self.backbone.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            _save_tensors(self.head.state_dict(), tmp / VALUE_HEAD_WEIGHTS)
            meta = {
                "format": "rlbits.ValueModel",
                "version": 1,
                "hidden_size": self.head.in_features,
                "attn_implementation": _attn(self.backbone),
            }
            (tmp / VALUE_HEAD_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
        return Path(path)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Values at every position.

        Args:
            input_ids: [B, T] int64.
            attention_mask: [B, T], 1/True on real tokens (left padding allowed).
            position_ids: [B, T] int64; pass ``(attention_mask.cumsum(-1) - 1).clamp(min=0)`` with left padding
                so a padded row gets the values of the unpadded one.

        Returns:
            [B, T] float32. Values at padding positions are meaningless; mask them.
        """
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        hidden = out.last_hidden_state
        return _float_not_a_view(self.head(hidden.to(self.head.weight.dtype)).squeeze(-1))


def _float_not_a_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 as a tensor of its own, not a view (same values).

    A module sharded with FSDP2 that returns a view (``squeeze(-1)`` of a head's ``[B, T, 1]`` output, or a
    ``Linear`` with bias on a 3-d input, which reshapes its 2-d result) makes FSDP2 warn on every rank and
    every forward that an in-place op on the view would skip its pre-backward hook and give wrong gradients.
    ``float()`` of a bf16 tensor already copies; a float32 view is cloned (the view's base is freed with it).
    """
    t = t.float()
    return t.clone() if t._base is not None else t


def make_head(hidden: int, out: int, layers: int = 2) -> nn.Module:
    """``Linear(hidden, out)`` (``layers=1``) or trlx's ``make_head``: ``Linear(hidden, 2 hidden) -> ReLU ->
    Linear(2 hidden, out)`` (``layers=2``). PyTorch's default init.

    Raises:
        ValueError: ``layers`` not 1 or 2.
    """
    if layers == 1:
        return nn.Linear(hidden, out)
    if layers == 2:
        return nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.ReLU(), nn.Linear(2 * hidden, out))
    raise ValueError(f"head_layers must be 1 (linear) or 2 (MLP, as trlx), got {layers}")


class ILQLModel(nn.Module):
    """Causal LM with ILQL heads (Snell 2022, "Offline RL for natural language generation with implicit
    language Q learning"; layout of trlx's ``AutoModelForCausalLMWithILQLHeads``).

    Modules: ``policy`` (trainable causal LM; its LM head gives the behaviour-cloned logits), ``q1``, ``q2``
    (Q over the vocabulary), ``target_q1``, ``target_q2`` (frozen copies, updated only by
    ``sync_target_q_heads``), ``v`` (scalar). Heads read the policy's last hidden state, or with
    ``shared_trunk=False`` that of ``trunk``, a trainable deep copy of the policy's backbone, so the Q/V
    losses do not move the policy's representation (at the cost of a second forward pass).

    Target heads hold parameters with ``requires_grad=False`` and run under ``no_grad``; optimise
    ``[p for p in model.parameters() if p.requires_grad]``.

    Args:
        policy: a transformers causal LM.
        two_qs: two Q heads (clipped double Q: losses use both, targets use their minimum); False keeps
            only ``q1``/``target_q1`` and ``forward`` returns no ``q2``/``target_q2``.
        head_layers: 2 for trlx's MLP heads (hidden -> 2 hidden -> out), 1 for linear heads.
        shared_trunk: heads read the policy's hidden states (True, as trlx) or their own trunk (False).
        seed: seeds the head init (None draws from the global RNG).

    Raises:
        TypeError: ``policy`` is not a transformers causal LM.
        ValueError: ``head_layers`` not 1 or 2.
    """

    def __init__(
        self,
        policy: PreTrainedModel,
        *,
        two_qs: bool = True,
        head_layers: int = 2,
        shared_trunk: bool = True,
        seed: int | None = 0,
    ):
        super().__init__()
        backbone = _backbone_of(policy)
        self.policy = policy
        self.trunk = None if shared_trunk else copy.deepcopy(backbone)
        self.two_qs = two_qs
        self.head_layers = head_layers
        lm_head = policy.get_output_embeddings()
        hidden = getattr(lm_head, "in_features", None) or policy.config.get_text_config().hidden_size
        vocab = getattr(lm_head, "out_features", None) or policy.config.get_text_config().vocab_size

        def make():
            qs = [make_head(hidden, vocab, head_layers) for _ in range(2 if two_qs else 1)]
            return qs, make_head(hidden, 1, head_layers)

        qs, self.v = _run_seeded(seed, make)
        self.q1 = qs[0]
        self.q2 = qs[1] if two_qs else None
        self.target_q1 = copy.deepcopy(self.q1).requires_grad_(False)
        self.target_q2 = copy.deepcopy(self.q2).requires_grad_(False) if two_qs else None

    @property
    def config(self):
        return self.policy.config

    def _pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        pairs = [(self.target_q1, self.q1)]
        if self.two_qs:
            pairs.append((self.target_q2, self.q2))
        return pairs

    @torch.no_grad()
    def sync_target_q_heads(self, alpha: float = 1.0) -> None:
        """Polyak update of the target Q heads, trlx's convention:
        ``target = alpha * online + (1 - alpha) * target``.

        ``alpha=1`` is a hard copy (periodic sync, trlx's ``steps_for_target_q_sync``); small ``alpha``
        (e.g. 0.005 every step) is a slow moving average; ``alpha=0`` leaves the targets unchanged.

        Raises:
            ValueError: ``alpha`` outside [0, 1].
        """
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1] (1 = hard copy), got {alpha}")
        for target, online in self._pairs():
            for t, o in zip(target.parameters(), online.parameters(), strict=True):
                if alpha == 1.0:
                    t.copy_(o)
                else:
                    t.mul_(1.0 - alpha).add_(o, alpha=alpha)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Policy logits and Q / V at every position (state after reading token t, before token t+1).

        Args:
            input_ids: [B, T] int64.
            attention_mask: [B, T], 1/True on real tokens (left padding allowed).
            position_ids: [B, T]; with left padding pass ``(attention_mask.cumsum(-1) - 1).clamp(min=0)``.

        Returns:
            dict with ``logits`` [B, T, V] (the policy's dtype), ``q1``, ``q2``, ``target_q1``,
            ``target_q2`` [B, T, V] float32 (target ones without grad; no ``q2``/``target_q2`` when
            ``two_qs=False``) and ``v`` [B, T] float32.
        """
        kw = dict(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        out = self.policy(**kw, output_hidden_states=self.trunk is None)
        hidden = out.hidden_states[-1] if self.trunk is None else self.trunk(**kw).last_hidden_state
        hidden = hidden.to(next(self.v.parameters()).dtype)
        result = {"logits": out.logits, "q1": _float_not_a_view(self.q1(hidden))}
        if self.two_qs:
            result["q2"] = _float_not_a_view(self.q2(hidden))
        with torch.no_grad():
            result["target_q1"] = self.target_q1(hidden).float()
            if self.two_qs:
                result["target_q2"] = self.target_q2(hidden).float()
        result["v"] = _float_not_a_view(self.v(hidden).squeeze(-1))
        return result

    def _head_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("policy.")}

    def save_pretrained(self, path: str | os.PathLike, tokenizer=None) -> Path:
        """Write the policy in HF format (so ``load_policy(path)`` gives the bare policy), the heads (and
        the separate trunk, if any) in ``ilql_heads.safetensors``, and their options in ``ilql_heads.json``.

        Atomic (see ``rlbits.models.load.atomic_folder``). ``ILQLModel.from_pretrained(path)`` loads it.
        """
        with atomic_folder(path) as tmp:
            self.policy.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            _save_tensors(self._head_state(), tmp / ILQL_HEADS_WEIGHTS)
            meta = {
                "format": "rlbits.ILQLModel",
                "version": 1,
                "two_qs": self.two_qs,
                "head_layers": self.head_layers,
                "shared_trunk": self.trunk is None,
                "attn_implementation": _attn(self.policy),
            }
            (tmp / ILQL_HEADS_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
        return Path(path)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        attn_implementation: str | None = None,
        two_qs: bool = True,
        head_layers: int = 2,
        shared_trunk: bool = True,
        seed: int | None = 0,
    ) -> ILQLModel:
        """Load an ILQL model saved by ``save_pretrained``, or start one from a causal-LM folder.

        With ``ilql_heads.json`` present the saved options win over ``two_qs``/``head_layers``/
        ``shared_trunk`` and the heads load exactly; otherwise fresh heads are built with those options.

        Raises:
            CheckpointNotFoundError, ValueError: as ``load_policy``; also ValueError if the saved heads do
                not match the options in ``ilql_heads.json``.
        """
        p = check_folder(path, "ILQL model")
        meta = read_json(p / ILQL_HEADS_CONFIG, "ILQL model") if (p / ILQL_HEADS_CONFIG).exists() else None
        attn = attn_implementation or (meta or {}).get("attn_implementation")
        policy = load_policy(p, dtype=dtype, attn_implementation=attn)
        if meta is not None:
            two_qs, head_layers, shared_trunk = meta["two_qs"], meta["head_layers"], meta["shared_trunk"]
        model = cls(policy, two_qs=two_qs, head_layers=head_layers, shared_trunk=shared_trunk, seed=seed)
        if meta is not None:
            state = _load_tensors(p / ILQL_HEADS_WEIGHTS, "ILQL model")
            expected = {k: tuple(v.shape) for k, v in model._head_state().items()}
            got = {k: tuple(v.shape) for k, v in state.items()}
            if got != expected:
                diff = sorted(set(got.items()) ^ set(expected.items()))[:6]
                raise ValueError(
                    f"{ILQL_HEADS_WEIGHTS} in {str(path)!r} does not match {ILQL_HEADS_CONFIG} "
                    f"(differing entries: {diff})"
                )
            missing, unexpected = model.load_state_dict(state, strict=False)
            assert not unexpected and all(k.startswith("policy.") for k in missing)
        if device is not None:
            model = model.to(device)
        return model.eval()


__all__ = [
    "ILQL_HEADS_CONFIG",
    "ILQL_HEADS_WEIGHTS",
    "VALUE_HEAD_CONFIG",
    "VALUE_HEAD_WEIGHTS",
    "ILQLModel",
    "ValueModel",
    "make_head",
]
