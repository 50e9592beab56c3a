"""The update engine (rlbits.loops.update) against a slow, obviously right reference: a tiny linear model whose
loss is a masked token mean, trained by hand on whole minibatches, gives the same steps and statistics as the
engine's microbatches; non-finite losses and gradients raise NonFiniteError and leave every model untouched."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from rlbits.batch import split_minibatches
from rlbits.distributed.env import DistEnv
from rlbits.functional import POLICY_LOSSES, aggregate_loss, masked_sum
from rlbits.loops.metrics import StepMetrics
from rlbits.loops.run import NonFiniteError
from rlbits.loops.update import Denominators, Trained, denominators, optimize

B, T, D = 6, 5, 3


def make_batch(seed: int = 0) -> TensorDict:
    """[B] rows of T tokens with D features, a target per token and uneven masks (1 to 5 tokens a row)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 5, 3, 2, 4, 5])
    return TensorDict(
        {
            "x": torch.randn(B, T, D, generator=gen),
            "y": torch.randn(B, T, generator=gen),
            "action_mask": torch.arange(T)[None, :] < lengths[:, None],
            "group": torch.arange(B) // 2,  # groups of two rows: minibatches keep them whole
        },
        [B],
    )


def state_for(*models: torch.nn.Module) -> SimpleNamespace:
    return SimpleNamespace(env=DistEnv(), metrics=StepMetrics(), step=0, models=models)


def cfg_for(microbatch_size: int, max_grad_norm: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(
        microbatch_size=microbatch_size, max_grad_norm=max_grad_norm, precision="fp32",
        max_tokens_per_microbatch=None, pack_sequences=False,
    )


def squared_error(model: torch.nn.Module, batch: TensorDict) -> torch.Tensor:
    return (model(batch["x"]).squeeze(-1) - batch["y"]).square()


def objective(state, micro, cfg, den: Denominators):
    """Token-mean squared error over the minibatch's global token count."""
    mask = micro["action_mask"]
    err = squared_error(state.models[0], micro)
    loss = masked_sum(err, mask) / den.num_tokens
    stats = {
        "loss": loss.detach(),
        "err": (masked_sum(err.detach(), mask), mask.sum()),
        "rows": err.sum(-1).detach(),
    }
    return loss, stats


def reference_step(
    model: torch.nn.Module, batch: TensorDict, lr: float, max_grad_norm: float = 0.0
) -> tuple[float, float]:
    """One SGD step on the whole ``batch``'s token-mean loss; returns the gradient norm before clipping and the loss."""
    mask = batch["action_mask"]
    loss = masked_sum(squared_error(model, batch), mask) / mask.sum()
    model.zero_grad()
    loss.backward()
    params = list(model.parameters())
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad
    return float(norm), float(loss.detach())


def linear(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(D, 1)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("microbatch_size", [1, 4, 6])
@pytest.mark.parametrize("max_grad_norm", [0.0, 0.1])
def test_microbatches_give_the_step_of_the_whole_batch(microbatch_size, max_grad_norm):
    model, ref = linear(), linear()
    batch = make_batch()
    state = state_for(model)
    rows = optimize(
        state, batch, cfg_for(microbatch_size, max_grad_norm), objective,
        trained=[Trained(model, torch.optim.SGD(model.parameters(), lr=0.1))],
    )
    norm, loss = reference_step(ref, batch, 0.1, max_grad_norm)
    torch.testing.assert_close(flat(model), flat(ref), rtol=0, atol=1e-6)
    logged = state.metrics.reduce(DistEnv())
    assert logged["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert logged["loss"] == pytest.approx(loss, rel=1e-5)  # a share of the minibatch: the whole loss
    assert logged["err"] == pytest.approx(loss, rel=1e-5)  # a token mean over the step: the same here
    assert rows["rows"].shape == (B,)  # 1-D stats come back, in row order
    assert all(p.grad is None for p in model.parameters())  # zeroed after the step


def test_epochs_and_shuffled_minibatches_step_each_minibatch_as_a_whole():
    model, ref = linear(), linear()
    batch = make_batch()
    state = state_for(model)
    gen, ref_gen = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    optimize(
        state, batch, cfg_for(1), objective, trained=[Trained(model, torch.optim.SGD(model.parameters(), lr=0.1))],
        epochs=2, num_minibatches=3, shuffle=gen,
    )
    losses, errs, counts, norms = [], [], [], []
    for _ in range(2):
        for minibatch in split_minibatches(batch, 3, generator=ref_gen):
            mask = minibatch["action_mask"]
            with torch.no_grad():
                errs.append(float(masked_sum(squared_error(ref, minibatch), mask)))
            counts.append(float(mask.sum()))
            norm, loss = reference_step(ref, minibatch, 0.1)
            norms.append(norm)
            losses.append(loss)
    torch.testing.assert_close(flat(model), flat(ref), rtol=0, atol=1e-6)
    logged = state.metrics.reduce(DistEnv())
    assert logged["loss"] == pytest.approx(sum(losses) / 6, rel=1e-5)  # mean over the 6 optimizer steps
    assert logged["err"] == pytest.approx(sum(errs) / sum(counts), rel=1e-5)  # token mean over the step
    assert logged["grad_norm"] == pytest.approx(sum(norms) / 6, rel=1e-5)


def test_several_optimizers_step_in_one_update_and_log_their_norms():
    a, b, ref_a, ref_b = linear(0), linear(1), linear(0), linear(1)
    batch = make_batch()

    def two_models(state, micro, cfg, den):
        mask = micro["action_mask"]
        err = squared_error(state.models[0], micro) + 2 * squared_error(state.models[1], micro)
        return masked_sum(err, mask) / den.num_tokens, {}

    state = state_for(a, b)
    trained = [Trained(a, torch.optim.SGD(a.parameters(), lr=0.1)),
               Trained(b, torch.optim.SGD(b.parameters(), lr=0.05), grad_norm="b_grad_norm")]
    optimize(state, batch, cfg_for(4), two_models, trained=trained)
    norm_a, _ = reference_step(ref_a, batch, 0.1)
    mask = batch["action_mask"]
    loss_b = masked_sum(2 * squared_error(ref_b, batch), mask) / mask.sum()
    loss_b.backward()
    norm_b = torch.nn.utils.get_total_norm([p.grad for p in ref_b.parameters()])
    with torch.no_grad():
        for p in ref_b.parameters():
            p -= 0.05 * p.grad
    torch.testing.assert_close(flat(a), flat(ref_a), rtol=0, atol=1e-6)
    torch.testing.assert_close(flat(b), flat(ref_b), rtol=0, atol=1e-6)
    logged = state.metrics.reduce(DistEnv())
    assert logged["grad_norm"] == pytest.approx(norm_a, rel=1e-5)
    assert logged["b_grad_norm"] == pytest.approx(float(norm_b), rel=1e-5)


def test_a_non_finite_loss_raises_naming_where_and_leaves_the_model_untouched():
    model = linear()
    batch = make_batch()
    batch["y"][3, 0] = float("nan")  # row 3 is in the second microbatch of 2 rows
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = flat(model).clone()
    with pytest.raises(NonFiniteError, match=r"^step 1, phase update, epoch 0, minibatch 0, microbatch 1: "
                       r"non-finite loss nan \(loss=nan, err=nan\)"):
        optimize(state_for(model), batch, cfg_for(2), objective, trained=[Trained(model, optimizer)])
    assert torch.equal(flat(model), before)
    assert all(p.grad is None for p in model.parameters())  # the first microbatch's gradient is gone too


def test_a_non_finite_gradient_raises_and_no_optimizer_steps():
    a, b = linear(0), linear(1)
    batch = make_batch()

    def inf_grad_in_b(state, micro, cfg, den):
        mask = micro["action_mask"]
        loss_a = masked_sum(squared_error(state.models[0], micro), mask) / den.num_tokens
        zero = (state.models[1].weight * 0).sum()
        return loss_a + torch.sqrt(zero), {}  # sqrt at 0: a finite loss, an infinite gradient

    before = flat(a).clone(), flat(b).clone()
    trained = [Trained(a, torch.optim.SGD(a.parameters(), lr=0.1)),
               Trained(b, torch.optim.SGD(b.parameters(), lr=0.1), grad_norm="b_grad_norm")]
    with pytest.raises(NonFiniteError, match=r"step 1, phase update, epoch 0, minibatch 0: non-finite gradient "
                       r"norm \(grad_norm=[0-9.e-]+, b_grad_norm=nan\); no optimizer stepped"):
        optimize(state_for(a, b), batch, cfg_for(3), inf_grad_in_b, trained=trained)
    assert torch.equal(flat(a), before[0]) and torch.equal(flat(b), before[1])  # a's finite step is not taken
    assert all(p.grad is None for m in (a, b) for p in m.parameters())


def test_denominators_count_tokens_sequences_and_rows():
    batch = make_batch()
    batch["action_mask"][0] = False
    den = denominators(batch, "action_mask", DistEnv())
    assert (float(den.num_tokens), float(den.num_seqs), float(den.num_rows)) == (19.0, 5.0, 6.0)
    rows = denominators(batch, None, DistEnv())
    assert (float(rows.num_tokens), float(rows.num_seqs), float(rows.num_rows)) == (6.0, 6.0, 6.0)
    empty = denominators(batch[:1], "action_mask", DistEnv())
    assert float(empty.num_tokens) == 1.0 and float(empty.num_seqs) == 1.0  # at least 1: no division by 0
    assert den.agg("token-mean") == {
        "agg": "token-mean",
        "num_tokens": den.num_tokens,
        "num_seqs": den.num_seqs,
    }


@pytest.mark.parametrize("factor", [None, 24.0])
def test_a_loss_scale_factor_reaches_every_loss(factor):
    """``seq-mean-token-sum-norm`` with verl's ``loss_scale_factor`` through ``Denominators.agg``: the value of
    ``aggregate_loss`` with that factor, also for the policy losses (which take no factor of their own)."""
    gen = torch.Generator().manual_seed(0)
    x, old, adv = (torch.randn(4, 6, generator=gen) for _ in range(3))
    mask = torch.rand(4, 6, generator=gen) > 0.3
    den = Denominators(num_tokens=torch.tensor(30.0), num_seqs=torch.tensor(7.0), num_rows=torch.tensor(7.0))
    agg = den.agg("seq-mean-token-sum-norm", factor)
    want = aggregate_loss(x, mask, "seq-mean-token-sum-norm", num_seqs=7.0, loss_scale_factor=factor)
    torch.testing.assert_close(aggregate_loss(x, mask, **agg), want)
    seq = torch.exp(((x - old) * mask).sum(1) / mask.sum(1).clamp(min=1))[:, None]
    want = aggregate_loss(-adv * seq, mask, "seq-mean-token-sum-norm", num_seqs=7.0, loss_scale_factor=factor)
    # gspo with clip ranges too wide to act: -A s, s the sequence ratio
    loss, _ = POLICY_LOSSES["gspo"](x, old, adv, mask, clip_eps=100.0, clip_eps_high=100.0, **agg)
    torch.testing.assert_close(loss, want)


def test_several_minibatches_need_a_shuffle_generator():
    model = linear()
    with pytest.raises(ValueError, match="needs a shuffle generator"):
        optimize(
            state_for(model), make_batch(), cfg_for(2), objective,
            trained=[Trained(model, torch.optim.SGD(model.parameters(), lr=0.1))], num_minibatches=2,
        )


def test_objective_runs_under_the_first_models_autocast():
    model = linear()
    seen = []

    def record(state, micro, cfg, den):
        seen.append(torch.is_autocast_enabled("cpu"))
        return objective(state, micro, cfg, den)

    cfg = copy.copy(cfg_for(6))
    cfg.precision = "bf16"
    optimize(
        state_for(model),
        make_batch(),
        cfg,
        record,
        trained=[Trained(model, torch.optim.SGD(model.parameters()))],
    )
    assert seen == [True]
