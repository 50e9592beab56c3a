"""Decoding on CPU through oneDNN with pre-packed weights: ``packed_linears``.

A decode step multiplies a few rows (the batch) by every weight matrix of the model, so on CPU it runs at
the speed of the matrix library's small-M kernel. PyTorch's CPU build ships two libraries: MKL, which
``F.linear`` calls in float32, and oneDNN, which ``torch.compile`` (inductor) calls for inference with
weights it has reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` and
``_linear_pointwise``, the ops of inductor's ``mkldnn_fusion`` pass). Measured on the 2-core AVX-512
benchmark machine (AMD EPYC, float32, 2 threads, weights out of cache as in a decode loop;
``benchmarks/bench_decode.py --matmuls``; ``benchmarks/RESULTS.md`` 1c): at 16 rows and SmolLM2-135M's
five weight shapes MKL ran 50-73 GFLOP/s and oneDNN on packed weights 68-151 GFLOP/s (the output layer
50 against 151); the same to float rounding (the same products summed in another order). Decoding 16 rows
of that model took 2.07 s instead of 3.23 s.

``packed_linears(model)`` reorders every ``nn.Linear`` and GPT-2 ``Conv1D`` weight of ``model`` once
and routes those layers' forward through oneDNN until the block ends. The reorder costs about one pass
over the weights (and one extra copy of them in memory while the block lasts), so it pays off over a
whole rollout, not a single forward. Gradients do not flow through the packed copy: a forward that needs
them (grad mode on and a weight that requires grad) falls back to the layer's own forward.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from rlbits.models.forward import _is_sharded
from rlbits.models.lora import _conv1d_type

__all__ = ["packed_linears", "packing_available"]

# The dtypes oneDNN's packed linear takes on CPU.
_PACKED_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _packed_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN can pack on this CPU: bfloat16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT,
    without which ``_reorder_linear_weight`` raises; such layers keep their own forward."""
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return _PACKED_DTYPES if bf16 is not None and bf16() else (torch.float32,)


def packing_available() -> bool:
    """Whether this PyTorch build has oneDNN's packed linear ops (the CPU wheels do)."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _packed_forward(module, original, packed, x: torch.Tensor) -> torch.Tensor:
    if (torch.is_grad_enabled() and module.weight.requires_grad) or torch.is_autocast_enabled("cpu"):
        return original(x)  # the packed copy is a constant (no gradient), and autocast would not cast it
    return torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, *, batch_size: int | None = None) -> Iterator[int]:
    """Within the block, every CPU ``nn.Linear`` and ``transformers`` ``Conv1D`` of ``model`` with a float32
    or bfloat16 weight computes its forward with oneDNN on a copy of its weight reordered once, on entry;
    yields how many layers it packed (0 when oneDNN's ops are missing, or for a model on another device or
    sharded by FSDP2).

    For decoding on CPU (``rlbits.rollout.generate`` uses it there by default): the outputs equal the
    layers' own to float rounding. The weights are read on entry, so an in-place change to them inside the
    block is not seen; while it lasts the packed copies take about as much memory as the weights.
    Forward hooks, LoRA wrappers and the modules themselves are untouched (only the instance's ``forward``
    is set, and removed on exit). A forward with grad mode on and a weight that requires grad, or under CPU
    autocast, runs the layer's own forward.

    Args:
        model: any module; its submodules are searched.
        batch_size: the row count the layout is tuned for (oneDNN's hint; any row count works).
    """
    patched: list[torch.nn.Module] = []
    try:
        # FSDP2: a local shard is not the weight, and the unshard hooks must run; a sharded model is left alone.
        if packing_available() and not any(_is_sharded(m) for m in model.modules()):
            with torch.no_grad():
                for module, weight in _packable(model):
                    packed = _reorder(weight, batch_size)
                    module.forward = functools.partial(_packed_forward, module, module.forward, packed)
                    patched.append(module)
        yield len(patched)
    finally:  # also when packing a later layer failed: every patched layer gets its own forward back
        for module in patched:
            del module.forward


def _packable(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, torch.Tensor]]:
    """``(layer, [out, in] weight)`` for each CPU float32/bfloat16 ``nn.Linear`` / ``Conv1D`` of ``model``
    whose forward is not already replaced."""
    conv1d = _conv1d_type()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        is_linear = type(module) is torch.nn.Linear
        is_conv1d = conv1d is not None and type(module) is conv1d
        if not (is_linear or is_conv1d) or not isinstance(weight, torch.Tensor):
            continue
        if weight.device.type != "cpu" or weight.dtype not in _packed_dtypes() or "forward" in vars(module):
            continue
        if module.bias is not None and module.bias.dtype != weight.dtype:
            continue
        # oneDNN takes the [out, in] weight of nn.Linear; Conv1D stores [in, out].
        yield module, (weight.detach() if is_linear else weight.detach().t().contiguous())


def _reorder(weight: torch.Tensor, batch_size: int | None) -> torch.Tensor:
    """oneDNN's blocked copy of an [out, in] weight (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_size)
