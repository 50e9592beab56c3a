"""Token log-probabilities and entropies from logits, without keeping a [B, R, V] copy for backward.

The plain ``log_softmax(logits / T).gather(...)`` keeps the scaled (and, for bf16, upcast) [B, R, V] tensor
alive for backward, doubling the largest activation of an RL update. ``logprobs_from_logits`` saves only the
logits it was given (alive anyway) and one float per token (the log-partition), and recomputes the softmax
chunk by chunk in backward.
"""

from __future__ import annotations

import torch

from rlbits.functional import _checks

# Elements per chunk of rows in eager mode (1 MiB of float32): small enough that the passes over a chunk hit
# the CPU cache (each of 2 threads gets half of it), and bounds the transient memory. On the 2-core benchmark
# machine (2 MiB L2 per core), [32, 32, 32000] logits: forward with entropy + backward 53.7 ms at 4 MiB,
# 46.7 at 2 MiB, 44.4 at 1 MiB; a no-grad forward 20.0 / 17.5 / 17.4 ms.
_CHUNK_ELEMENTS = 1 << 18


def _rows_per_chunk(n_rows: int, vocab: int) -> int:
    if torch.compiler.is_compiling():
        return max(n_rows, 1)  # inductor fuses the reduction; unrolled chunks would only slow compilation
    return max(1, min(n_rows, _CHUNK_ELEMENTS // max(vocab, 1)))


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits / T)[token] with backward g / T * (onehot(token) - softmax(logits / T)).

    With ``with_entropy`` the second output is the entropy of each row, computed in the same pass over each
    chunk (a metric: no gradient flows through it); else it is empty.
    """

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        idx = tokens.reshape(-1, 1)
        dtype = _checks.compute_dtype(logits)
        n = flat.shape[0]
        out = torch.empty(n, dtype=dtype, device=logits.device)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        ent = torch.empty(n if with_entropy else 0, dtype=dtype, device=logits.device)
        step = _rows_per_chunk(n, vocab)
        if with_entropy:  # two chunk-sized work buffers, reused by every chunk
            shifted, weights = torch.empty(2, min(step, n), vocab, dtype=dtype, device=logits.device)
        for s in range(0, n, step):
            chunk = flat[s : s + step].to(dtype)
            if temperature != 1.0:
                chunk = chunk / temperature
            if with_entropy:
                # One pass for both: z' = z - max, S = sum exp z', lse = max + log S and
                # H = lse - sum(p z) = log S - sum(exp(z') z') / S.
                k = chunk.shape[0]
                peak = chunk.amax(dim=-1, keepdim=True)
                z = torch.sub(chunk, peak, out=shifted[:k])
                e = torch.exp(z, out=weights[:k])
                total = e.sum(dim=-1, keepdim=True)
                log_total = total.log()
                chunk_lse = (peak + log_total).squeeze(1)
                ent[s : s + step] = (log_total - e.mul_(z).sum(dim=-1, keepdim=True) / total).squeeze(1)
            else:
                chunk_lse = torch.logsumexp(chunk, dim=-1)
            lse[s : s + step] = chunk_lse
            out[s : s + step] = chunk.gather(-1, idx[s : s + step]).squeeze(-1) - chunk_lse
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature = temperature
        ent = ent.view(tokens.shape) if with_entropy else ent
        ctx.mark_non_differentiable(ent)
        return out.view(tokens.shape), ent

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, grad_entropy: torch.Tensor | None):
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
            return grad.view(logits.shape), None, None, None
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
        return grad.view(logits.shape), None, None, None


def _check_tokens(name: str, x: torch.Tensor, tokens: torch.Tensor, temperature: float) -> None:
    """``tokens`` is an integer tensor of shape ``x.shape[:-1]``, and ``temperature > 0``."""
    if x.shape[:-1] != tokens.shape:
        raise ValueError(
            f"tokens has shape {tuple(tokens.shape)} but {name} has shape {tuple(x.shape)}; "
            f"tokens must equal {name}.shape[:-1]"
        )
    if tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be an integer tensor, got dtype {tokens.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _nonempty_vocab(logits: torch.Tensor) -> None:
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits has shape {tuple(logits.shape)}: it needs a last (vocabulary) dimension of size >= 1")


def logprobs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, *, return_entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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
        return_entropy: also return the entropy of ``softmax(logits / T)`` at each position, computed in
            the same pass over each chunk of rows (no [..., V] temporaries). It carries **no gradient**
            (a metric); for an entropy bonus use ``entropy_from_logits``.

    Returns:
        [...] float32 (float64 for float64 logits), differentiable w.r.t. ``logits``; with
        ``return_entropy``, ``(logprobs, entropy)``, entropy [...] in the same dtype, detached.

    Raises:
        ValueError: shapes disagree, tokens are not integers, logits are not floating point, or
            ``temperature <= 0``.
    """
    _checks.floating("logits", logits)
    _nonempty_vocab(logits)
    _check_tokens("logits", logits, tokens, temperature)
    logprobs, entropy = _TokenLogprobs.apply(logits, tokens.long(), float(temperature), bool(return_entropy))
    return (logprobs, entropy) if return_entropy else logprobs


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
    _nonempty_vocab(logits)
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


# --- fused output layer + logprobs ------------------------------------------------------------------------

# Elements of one [rows, V] logits chunk in the fused head (16 MiB of float32): large enough for an efficient
# matmul, small enough to stay in cache for the softmax passes over it.
_HEAD_CHUNK_ELEMENTS = 1 << 22


def _softmax_dtype(mm_dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else runs its softmax in float32."""
    return torch.float64 if mm_dtype == torch.float64 else torch.float32


def _head_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The matmul dtype: autocast's when it is on for this device, else the hidden states'."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


class _HiddenTokenLogprobs(torch.autograd.Function):
    """Token logprobs (and entropies) of ``softmax(hidden @ weight.T / T)`` computed chunk by chunk.

    Forward keeps only the log-partition and entropy per row; backward recomputes each chunk's logits (one
    extra matmul) rather than storing [N, V]. Gradient of ``logp = z[tok] - lse(z)`` with ``z = logits / T``:
    ``g (onehot - p) / T``; of ``H = lse(z) - sum p z``: ``-p (log p + H) / T``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, mm_dtype):
        n, vocab = hidden.shape[0], weight.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(mm_dtype)
            w = weight.to(mm_dtype)
            rows = max(1, min(n, _HEAD_CHUNK_ELEMENTS // max(vocab, 1)))
            cdt = _softmax_dtype(mm_dtype)
            opts = dict(dtype=cdt, device=hidden.device)
            buf = torch.empty(rows, vocab, dtype=mm_dtype, device=hidden.device)
            z32 = buf if mm_dtype == cdt else torch.empty(rows, vocab, **opts)
            e = torch.empty(rows, vocab, **opts)
            logp = torch.empty(n, **opts)
            lse = torch.empty(n, **opts)
            ent = torch.empty(n, **opts)
            idx = tokens.reshape(-1, 1)
            for s in range(0, n, rows):
                k = min(rows, n - s)
                z = z32[:k]
                torch.mm(h[s : s + k], w.t(), out=buf[:k])
                if z32 is not buf:
                    z.copy_(buf[:k])
                if temperature != 1.0:
                    z.div_(temperature)
                peak = z.amax(dim=-1, keepdim=True)
                z.sub_(peak)  # z - max: exp cannot overflow
                p = torch.exp(z, out=e[:k])
                total = p.sum(dim=-1, keepdim=True)
                log_total = total.log()
                lse[s : s + k] = (peak + log_total).squeeze(1)
                logp[s : s + k] = (z.gather(1, idx[s : s + k]) - log_total).squeeze(1)
                # H = log S - sum(e * z') / S with z' = z - max and S = sum(e)
                ent[s : s + k] = (log_total - p.mul_(z).sum(dim=-1, keepdim=True) / total).squeeze(1)
        ctx.save_for_backward(hidden, weight, tokens, lse, ent)
        ctx.temperature = temperature
        ctx.mm_dtype = mm_dtype
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, tokens, lse, ent = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None, None, None
        temperature, mm_dtype = ctx.temperature, ctx.mm_dtype
        n, vocab = hidden.shape[0], weight.shape[0]
        device = hidden.device
        inv_t = 1.0 / temperature
        with torch.autocast(device.type, enabled=False):
            h = hidden.to(mm_dtype)
            w = weight.to(mm_dtype)
            rows = max(1, min(n, _HEAD_CHUNK_ELEMENTS // max(vocab, 1)))
            cdt = lse.dtype
            buf = torch.empty(rows, vocab, dtype=mm_dtype, device=device)
            z32 = buf if mm_dtype == cdt else torch.empty(rows, vocab, dtype=cdt, device=device)
            e = torch.empty(rows, vocab, dtype=cdt, device=device)
            e_mm = e if mm_dtype == cdt else torch.empty(rows, vocab, dtype=mm_dtype, device=device)
            grad_h = torch.empty(n, hidden.shape[1], dtype=mm_dtype, device=device)
            grad_w = torch.zeros(weight.shape, dtype=cdt, device=device)
            part_w = None if mm_dtype == cdt else torch.empty(weight.shape, dtype=mm_dtype, device=device)
            idx = tokens.reshape(-1, 1)
            gl = (g_logp.reshape(-1, 1).to(cdt) * inv_t) if g_logp is not None else None
            ge = (g_ent.reshape(-1, 1).to(cdt) * inv_t) if g_ent is not None else None
            for s in range(0, n, rows):
                k = min(rows, n - s)
                z = z32[:k]
                torch.mm(h[s : s + k], w.t(), out=buf[:k])
                if z32 is not buf:
                    z.copy_(buf[:k])
                if temperature != 1.0:
                    z.div_(temperature)
                z.sub_(lse[s : s + k, None])  # log p
                p = torch.exp(z, out=e[:k])
                # d/dz of gl * logp[tok] + ge * H  =  gl (onehot - p) - ge p (log p + H)
                if ge is None:
                    p.mul_(-gl[s : s + k])
                else:
                    coef = z.add_(ent[s : s + k, None]).mul_(ge[s : s + k])
                    if gl is not None:
                        coef.add_(gl[s : s + k])
                    p.mul_(coef).neg_()
                if gl is not None:
                    p.scatter_add_(1, idx[s : s + k], gl[s : s + k])
                g = p if e_mm is e else e_mm[:k].copy_(p)
                torch.mm(g, w, out=grad_h[s : s + k])
                if part_w is None:
                    grad_w.addmm_(g.t(), h[s : s + k])
                else:
                    grad_w.add_(torch.mm(g.t(), h[s : s + k], out=part_w))
        return grad_h.to(hidden.dtype), grad_w.to(weight.dtype), None, None, None


def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    *,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Token logprobs of a linear output layer without ever holding the [N, V] logits.

    ``logprobs_from_logits(hidden @ weight.T, tokens, temperature)``, computed over chunks of ~16 MiB of
    logits at a time (Liger-kernel's fused linear cross-entropy, applied to RL's per-token logprobs): the
    forward pass keeps one float per row; the backward pass recomputes each chunk's logits (a third matmul)
    and writes ``d hidden`` and ``d weight`` directly. The peak memory of the head drops from several
    [B, R, V] copies to one chunk, for one more matmul (1.3x the time of ``F.linear`` +
    ``logprobs_from_logits`` at B = 2, R = 1024, V = 32k on 2 CPU threads). Under ``torch.autocast`` the matmuls run in the autocast dtype (e.g.
    bf16) and the softmax in float32.

    Args:
        hidden: [..., H] float, the final hidden states (after the last norm) that predict ``tokens``.
        weight: [V, H] the output layer's weight (the tied embedding for GPT-2); no bias.
        tokens: [...] int64 in ``[0, V)``, the shape of ``hidden`` without its last dim.
        temperature: > 0.
        return_entropy: also return the entropy of ``softmax(logits / T)`` (differentiable).

    Returns:
        [...] float32 logprobs, or ``(logprobs, entropy)``; both differentiable w.r.t. ``hidden`` and
        ``weight``.

    Raises:
        ValueError: shapes disagree, tokens are not integers, or ``temperature <= 0``.
    """
    _checks.floating("hidden", hidden)
    _checks.floating("weight", weight)
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, got {tuple(weight.shape)}"
        )
    _check_tokens("hidden", hidden, tokens, temperature)
    flat = hidden.reshape(-1, hidden.shape[-1])
    logp, ent = _HiddenTokenLogprobs.apply(
        flat, weight, tokens.reshape(-1).long(), float(temperature), _head_dtype(hidden)
    )
    logp = logp.view(tokens.shape)
    if return_entropy:
        return logp, ent.view(tokens.shape)
    return logp
