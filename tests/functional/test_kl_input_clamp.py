"""``kl_penalty(input_clamp=...)`` against NeMo-RL's ``calculate_kl`` (nemo_rl/algorithms/utils.py), re-written."""

import pytest
import torch

import rlbits


def nemo_rl_calculate_kl(logprobs, logprobs_reference, kl_type, input_clamp_value, output_clamp_value):
    # NeMo-RL's order: log r = ref - logp, clamp r's log, the estimator, then clamp the output.
    logr = logprobs_reference - logprobs
    if input_clamp_value is not None:
        logr = logr.clamp(min=-input_clamp_value, max=input_clamp_value)
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = torch.square(logr) / 2
    else:
        kl = torch.exp(logr) - 1 - logr
    if output_clamp_value is not None:
        kl = kl.clamp(min=-output_clamp_value, max=output_clamp_value)
    return kl


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize(("input_clamp", "clamp"), [(20.0, 10.0), (0.7, None), (1.5, 3.0), (None, 10.0)])
def test_input_clamp_matches_nemo_rl(estimator, input_clamp, clamp):
    gen = torch.Generator().manual_seed(3)
    lp = (torch.randn(4, 7, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    ref_lp = torch.randn(4, 7, generator=gen, dtype=torch.float64) * 3
    lp[0, -2:].data.zero_()  # padding: both 0
    ref_lp[0, -2:] = 0
    got = rlbits.kl_penalty(lp, ref_lp, estimator, clamp=clamp, input_clamp=input_clamp)
    want = nemo_rl_calculate_kl(lp, ref_lp, estimator, input_clamp, clamp)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    (g,) = torch.autograd.grad(got.sum(), lp)
    (g_ref,) = torch.autograd.grad(want.sum(), lp)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)


def test_input_clamp_differs_from_output_clamp_and_stops_gradients():
    x = torch.tensor([[-5.0, 0.5, 5.0]], requires_grad=True)
    out = rlbits.kl_penalty(x, torch.zeros(1, 3), "k3+", input_clamp=1.0)
    # k3 of the clipped d = +-1, not of +-5
    torch.testing.assert_close(
        out.detach(), torch.expm1(-torch.tensor([[-1.0, 0.5, 1.0]])) + torch.tensor([[-1.0, 0.5, 1.0]])
    )
    (g,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(g, torch.tensor([[0.0, 0.5, 0.0]]))


def test_input_clamp_rejects_bad_values():
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="input_clamp"):
            rlbits.kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), input_clamp=bad)
