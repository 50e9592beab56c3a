"""Steered decoding with a trained ILQL model: ``SteeredPolicy`` turns an ``ILQLModel`` into a causal LM whose
logits are ``logits + beta * (min_i target_Q_i(s, .) - V(s))`` (``rlbits.functional.ilql_logits``), with
trlx's optional ``logit_mask``, so plain ``generate`` decodes steered, KV cache included."""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from rlbits.functional import ilql_logit_mask, ilql_logits
from rlbits.models.forward import cache_argument, output_cache
from rlbits.models.heads import ILQLModel

# The output's cache field: ``cache`` in transformers 5.2x (``past_key_values`` there logs a deprecation).
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _checked_mask(model: ILQLModel, logit_mask: Any) -> torch.Tensor:
    """``logit_mask`` if it is a bool [V, V] tensor over the model's vocabulary (its Q heads' outputs)."""
    vocab = [x for x in model.q1.modules() if isinstance(x, torch.nn.Linear)][-1].out_features
    if not isinstance(logit_mask, torch.Tensor):
        raise ValueError(f"logit_mask must be a bool [V, V] tensor, got {type(logit_mask).__name__}")
    if logit_mask.dtype != torch.bool or tuple(logit_mask.shape) != (vocab, vocab):
        raise ValueError(
            f"logit_mask must be a bool [V, V] tensor with V = {vocab} (the model's vocabulary), got "
            f"{logit_mask.dtype} {tuple(logit_mask.shape)}"
        )
    return logit_mask


class SteeredPolicy(torch.nn.Module):
    """An ``ILQLModel`` seen as a causal LM whose logits are ``ilql_logits(logits, min target Q, V, beta)``.

    ``generate(SteeredPolicy(model, beta), ...)`` then decodes steered with the usual KV cache: the forward
    passes ``past_key_values``/``use_cache``/``logits_to_keep`` to the LM, reads its last hidden state and
    runs the target Q heads and the V head on the kept positions only. With ``shared_trunk=False`` the
    separate trunk keeps a cache of its own (reset on every prefill), and generation uses HF's dynamic
    cache. ``beta=0`` returns the LM's own logits (as float32).

    With ``logit_mask`` (trlx's ``generate(logit_mask=...)``, ``trlx/models/modeling_ilql.py``) the logits at
    each position are masked after that position's input token (``ilql_logit_mask``): ``mask[i, j]`` True
    forbids token j right after token i, at every beta, 0 included (as trlx).

    Args:
        model: the ILQL model (not copied; it is the same module).
        beta: steering strength, >= 0.
        logit_mask: [V, V] bool over the LM's output vocabulary, or None (no mask). Moved to the model's
            device on first use.

    Raises:
        TypeError: ``model`` is not an ``ILQLModel``. ValueError: a bad ``beta``, or a ``logit_mask`` that is
            not a bool [V, V] tensor over the model's vocabulary.
    """

    def __init__(self, model: ILQLModel, beta: float, logit_mask: torch.Tensor | None = None):
        super().__init__()
        if not isinstance(model, ILQLModel):
            raise TypeError(f"model must be an rlbits ILQLModel, got {type(model).__name__}")
        if not (math.isfinite(beta) and beta >= 0):
            raise ValueError(f"beta must be a finite number >= 0, got {beta}")
        self.model = model
        self.beta = float(beta)
        self.logit_mask = None if logit_mask is None else _checked_mask(model, logit_mask)
        self._trunk_cache = None

    @property
    def config(self):
        return self.model.policy.config

    @property
    def _can_compile_fullgraph(self) -> bool:  # read by generate: a StaticCache only with one trunk
        return self.model.trunk is None and bool(getattr(self.model.policy, "_can_compile_fullgraph", False))

    def select_cache_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` [A] int64 of the separate trunk's KV cache (``generate`` calls it when it drops
        finished rows from the decode batch: ``rlbits.rollout.decoder.select_rows``)."""
        if self._trunk_cache is not None:
            self._trunk_cache.batch_select_indices(rows)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
    ) -> CausalLMOutputWithPast:
        m = self.model
        kw = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        out = m.policy(
            **kw,
            **{cache_argument(m.policy): past_key_values},
            use_cache=use_cache,
            output_hidden_states=m.trunk is None,
            logits_to_keep=logits_to_keep,
        )
        if m.trunk is None:
            hidden = out.hidden_states[-1]
        else:
            if past_key_values is None:  # prefill: start the trunk's own cache
                self._trunk_cache = None
            cache = self._trunk_cache if use_cache else None
            mask = attention_mask
            if mask is not None and cache is not None:
                mask = mask[:, : cache.get_seq_length() + input_ids.shape[1]]
            t_kw = {**kw, "attention_mask": mask, cache_argument(m.trunk): cache}
            t_out = m.trunk(**t_kw, use_cache=use_cache)
            self._trunk_cache = output_cache(t_out) if use_cache else None
            hidden = t_out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        hidden = hidden.to(next(m.v.parameters()).dtype)
        logits = out.logits.float()
        if self.beta != 0:
            with torch.no_grad():
                q = m.target_q1(hidden).float()
                if m.two_qs:
                    q = torch.minimum(q, m.target_q2(hidden).float())
                v = m.v(hidden).squeeze(-1).float()
            logits = ilql_logits(logits, q, v, self.beta)
        if self.logit_mask is not None:  # the logits at t follow input token t
            if self.logit_mask.device != logits.device:
                self.logit_mask = self.logit_mask.to(logits.device)
            logits = ilql_logit_mask(logits, input_ids[:, input_ids.shape[1] - logits.shape[1] :], self.logit_mask)
        return CausalLMOutputWithPast(
            logits=logits, **{_CACHE_FIELD: output_cache(out) if use_cache else None}
        )


__all__ = ["SteeredPolicy"]
