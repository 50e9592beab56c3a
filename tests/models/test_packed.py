"""``packed_linears``: oneDNN on reordered weights gives each layer's own output, and ``generate`` samples
the same with and without it."""

from __future__ import annotations

import pytest
import torch
from transformers.pytorch_utils import Conv1D

from rlbits.models.packed import _packed_dtypes, packed_linears, packing_available
from rlbits.models.tiny import tiny_causal_lm
from rlbits.rollout.generate import generate
from rlbits.text import make_prompts

pytestmark = pytest.mark.skipif(not packing_available(), reason="this PyTorch build has no oneDNN")

ARCHS = ("gpt2", "llama", "qwen2")
V = 64


def _layers(model):
    return [m for m in model.modules() if type(m) in (torch.nn.Linear, Conv1D)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_forward_equals_own_forward(arch, dtype):
    """Every Linear/Conv1D is packed, the whole model's logits match the unpacked ones (3-D inputs, bias
    and no bias, tied head), and the layers' own forward is back after the block."""
    model = tiny_causal_lm(arch, V, seed=1).to(dtype).eval()
    ids = torch.randint(3, V - 1, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        with packed_linears(model, batch_size=3) as n:
            # a CPU without bf16 oneDNN kernels (no AVX-512) packs nothing in bfloat16: each layer runs its own
            packs = dtype in _packed_dtypes()
            assert n == (len(_layers(model)) if packs else 0) and len(_layers(model)) > 0
            assert all(("forward" in vars(m)) == packs for m in _layers(model))
            got = model(ids).logits
    assert all("forward" not in vars(m) for m in _layers(model))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)


def test_packed_layer_matches_a_loop_over_rows():
    """One packed Linear against the obviously-right sum over input features, row by row."""
    g = torch.Generator().manual_seed(2)
    layer = torch.nn.Linear(5, 3)
    x = torch.randn(4, 2, 5, generator=g)
    want = torch.empty(4, 2, 3)
    for i in range(4):
        for j in range(2):
            for o in range(3):
                w, b = layer.weight.detach(), float(layer.bias[o])
                want[i, j, o] = sum(float(x[i, j, k]) * float(w[o, k]) for k in range(5)) + b
    with torch.no_grad(), packed_linears(layer) as n:
        assert n == 1
        got = layer(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_gradient_and_autocast_fall_back_to_own_forward():
    """With grad mode on, a weight that requires grad gets its gradient (the layer's own forward runs);
    under CPU autocast the output is autocast's bfloat16, as without packing."""
    layer = torch.nn.Linear(6, 4)
    x = torch.randn(3, 6)
    with packed_linears(layer):
        out = layer(x)
        out.sum().backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = layer(x)
    torch.testing.assert_close(layer.weight.grad, x.sum(0).expand(4, 6))
    assert auto.dtype == torch.bfloat16


def test_weight_read_on_entry_and_other_devices_untouched():
    """The packed copy is taken on entry; modules outside float32/bfloat16 on CPU are left alone."""
    layer = torch.nn.Linear(4, 4, bias=False)
    half = torch.nn.Linear(4, 4).half()
    x = torch.randn(2, 4)
    with torch.no_grad():
        before = layer(x)
        with packed_linears(torch.nn.Sequential(layer, half)) as n:
            assert n == 1 and "forward" not in vars(half)
            layer.weight.mul_(2)  # not seen inside the block
            torch.testing.assert_close(layer(x), before)
        torch.testing.assert_close(layer(x), 2 * before)


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_packed_equals_unpacked(arch):
    """``generate`` (default: packed on CPU) samples the same tokens with the same logprobs as with
    ``pack_weights=False``, on left-padded prompts with several samples each."""
    model = tiny_causal_lm(arch, V, seed=3)
    g = torch.Generator().manual_seed(4)
    td = make_prompts([torch.randint(3, V - 1, (n,), generator=g).tolist() for n in (3, 6, 2)], 0)
    kw = dict(max_new_tokens=8, temperature=0.8, eos_token_id=V - 1, pad_token_id=0, num_samples=2)
    plain = generate(model, td, **kw, generator=torch.Generator().manual_seed(5), pack_weights=False)
    packed = generate(model, td, **kw, generator=torch.Generator().manual_seed(5))
    assert torch.equal(plain["responses"], packed["responses"])
    torch.testing.assert_close(plain["logprobs"], packed["logprobs"], atol=1e-5, rtol=0)
    assert all("forward" not in vars(m) for m in _layers(model))


def test_a_failed_reorder_restores_the_layers_already_packed(monkeypatch):
    """If packing fails part-way (here the third layer's reorder), the error propagates and every layer
    packed before it gets its own forward back: nothing is left patched."""
    import rlbits.models.packed as packed_mod

    model = tiny_causal_lm("llama", V, seed=1)
    original, calls = packed_mod._reorder, []

    def failing(weight, batch_size):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("reorder failed")
        return original(weight, batch_size)

    monkeypatch.setattr(packed_mod, "_reorder", failing)
    with pytest.raises(RuntimeError, match="reorder failed"), packed_linears(model):
        pass
    assert len(calls) == 3
    assert all("forward" not in vars(m) for m in _layers(model))
