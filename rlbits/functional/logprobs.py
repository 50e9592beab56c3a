"""Token log-probabilities and entropies from logits, without keeping a [B, R, V] copy for backward.

The plain ``log_softmax(logits / T).gather(...)`` keeps the scaled (and, for bf16, upcast) [B, R, V] tensor
alive for backward, doubling the largest activation of an RL update. ``logprobs_from_logits`` saves only the
logits it was given (alive anyway) and one float per token (the log-partition), and recomputes the softmax
chunk by chunk in backward.
"""

from __future__ import annotations

import torch

from rlbits.functional import _checks

# Elements per chunk of rows in eager mode (4 MiB of float32): small enough that the passes over a chunk hit
# the CPU cache, and bounds the transient memory.
_CHUNK_ELEMENTS = 1 << 20


def _rows_per_chunk(n_rows: int, vocab: int) -> int:
    if torch.compiler.is_compiling():
        return max(n_rows, 1)  # inductor fuses the reduction; unrolled chunks would only slow compilation
    return max(1, min(n_rows, _CHUNK_ELEMENTS // max(vocab, 1)))


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits / T)[token] with backward g / T * (onehot(token) - softmax(logits / T))."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        idx = tokens.reshape(-1, 1)
        dtype = _checks.compute_dtype(logits)
        n = flat.shape[0]
        out = torch.empty(n, dtype=dtype, device=logits.device)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        step = _rows_per_chunk(n, vocab)
        for s in range(0, n, step):
            chunk = flat[s : s + step].to(dtype)
            if temperature != 1.0:
                chunk = chunk / temperature
            chunk_lse = torch.logsumexp(chunk, dim=-1)
            lse[s : s + step] = chunk_lse
            out[s : s + step] = chunk.gather(-1, idx[s : s + step]).squeeze(-1) - chunk_lse
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature = temperature
        return out.view(tokens.shape)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, tokens, lse = ctx.saved_tensors
        temperature = ctx.temperature
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        idx = tokens.reshape(-1, 1)
        g = grad_out.reshape(-1, 1).to(lse.dtype) / temperature
        n = flat.shape[0]
        step = _rows_per_chunk(n, vocab)
        if step >= n or lse.dtype != logits.dtype:
            # One pass (compiled) or a dtype change: out-of-place, inductor fuses it.
            grad = torch.empty_like(flat)
            for s in range(0, n, step):
                chunk = flat[s : s + step].to(lse.dtype)
                if temperature != 1.0:
                    chunk = chunk / temperature
                probs = torch.exp(chunk - lse[s : s + step, None])
                chunk_grad = -probs * g[s : s + step]
                chunk_grad.scatter_add_(-1, idx[s : s + step], g[s : s + step])
                grad[s : s + step] = chunk_grad
            return grad.view(logits.shape), None, None
        # Eager, same dtype: write each cache-sized chunk of the gradient in place, no temporaries.
        grad = torch.empty_like(flat)
        for s in range(0, n, step):
            out = grad[s : s + step]
            chunk = flat[s : s + step]
            if temperature != 1.0:
                torch.div(chunk, temperature, out=out)
                out.sub_(lse[s : s + step, None])
            else:
                torch.sub(chunk, lse[s : s + step, None], out=out)
            out.exp_().mul_(-g[s : s + step])
            out.scatter_add_(-1, idx[s : s + step], g[s : s + step])
        return grad.view(logits.shape), None, None


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each token under ``softmax(logits / temperature)``.

    ``log p(token) = logits[token] / T - logsumexp(logits / T)``: a gather minus a log-partition, computed
    in float32 (float64 stays float64) in chunks of rows. Only the input logits and one float per token are
    kept for backward, never a second [B, R, V] tensor. Logits must already be aligned with ``tokens``
    (``logits[:, t]`` predicts ``tokens[:, t]``).

    Args:
        logits: [..., V] (typically [B, R, V]), float32 or bf16.
        tokens: [...] int64 in ``[0, V)`` (the shape of ``logits`` without its last dim).
        temperature: the sampling temperature (> 0); behaviour logprobs must use the temperature the
            responses were sampled at.

    Returns:
        [...] float32 (float64 for float64 logits), differentiable w.r.t. ``logits``.

    Raises:
        ValueError: shapes disagree, tokens are not integers, logits are not floating point, or
            ``temperature <= 0``.
    """
    _checks.floating("logits", logits)
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(
            f"tokens has shape {tuple(tokens.shape)} but logits has shape {tuple(logits.shape)}; "
            "tokens must equal logits.shape[:-1]"
        )
    if tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be an integer tensor, got dtype {tokens.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _TokenLogprobs.apply(logits, tokens.long(), float(temperature))


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` over the last dimension, in nats.

    ``H = logsumexp(z) - sum(softmax(z) * z)`` with ``z = logits / T``, in float32. When no gradient is
    needed it runs in chunks of rows, so measuring entropy never holds a [B, R, V] float32 copy.

    Args:
        logits: [..., V], float32 or bf16.
        temperature: > 0.

    Returns:
        [...] float32 (float64 for float64 logits); differentiable (for an entropy bonus).

    Raises:
        ValueError: logits are not floating point or ``temperature <= 0``.
    """
    _checks.floating("logits", logits)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dtype = _checks.compute_dtype(logits)

    def entropy(z: torch.Tensor) -> torch.Tensor:
        z = z.to(dtype)
        if temperature != 1.0:
            z = z / temperature
        logp = torch.log_softmax(z, dim=-1)
        return -(logp.exp() * logp).sum(-1)

    if torch.is_grad_enabled() and logits.requires_grad:
        return entropy(logits)
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    if flat.shape[0] == 0:
        return torch.zeros(logits.shape[:-1], dtype=dtype, device=logits.device)
    step = _rows_per_chunk(flat.shape[0], vocab)
    parts = [entropy(flat[s : s + step]) for s in range(0, flat.shape[0], step)]
    return torch.cat(parts).view(logits.shape[:-1])
