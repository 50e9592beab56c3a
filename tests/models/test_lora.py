"""LoRA (``rlbits.models.lora``, ``lora_rank > 0``): config checks, adapters on GPT-2/Llama/Qwen2, the reference
as the policy with adapters disabled (no second copy), the optimizers' parameters, merged export, and (slow)
a short run of every loop, exact resume, and FSDP2 at world size 2."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from metrics_compare import untimed_by_step
from transformers import AutoModelForCausalLM

from rlbits.data.stream import prompt_batch
from rlbits.distributed.checkpoint import export_model, latest_checkpoint, load_checkpoint
from rlbits.loops import ilql, ppo, reinforce
from rlbits.loops.config import ConfigError, config_from_dict, load_config
from rlbits.loops.phases import reference_model
from rlbits.loops.run import read_metrics
from rlbits.loops.runtime import build_policy, fused_gelu, setup
from rlbits.models.forward import policy_logprobs
from rlbits.models.load import load_policy, save_pretrained
from rlbits.models.lora import adapters_disabled, apply_lora, is_lora, merge_lora
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
V = 32
PROMPTS = ["1+2=", "3+4=", "5+6=", "7+1=", "2+2=", "9+0=", "4+4=", "8+1="]


def length_reward(prompts, responses, **_):
    return [float(len(r) % 3) for r in responses]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora") / "policy"
    save_pretrained(tiny_causal_lm("gpt2", V, seed=0), tiny_tokenizer(V), path)
    return str(path)


COMMON = dict(
    task="arithmetic", max_num_steps=2, max_new_tokens=5, microbatch_size=4,
    learning_rate=1e-2, max_val_samples=4, log_samples=2, progress=False, tensorboard=False, lora_rank=4,
)
LOOPS = {
    "reinforce": (reinforce.ReinforceConfig, dict(num_prompts_per_step=4, num_generations_per_prompt=4, kl_loss_coef=0.05)),
    "ppo": (ppo.PPOConfig, dict(num_prompts_per_step=4, num_generations_per_prompt=2, ppo_epochs=1, num_minibatches=2)),
    "ilql": (ilql.ILQLConfig, dict(batch_size=4, dataset_size=8, dataset_batch_size=8)),
}


def make_cfg(loop, tiny_path, run_dir, **overrides):
    cls, extra = LOOPS[loop]
    return config_from_dict(
        cls, {**COMMON, **extra, "policy": tiny_path, "run_dir": str(run_dir), **overrides}
    )


def lora_numel(model):
    """Adapter parameters by the formula: r * (in + out) per adapted layer."""
    total = 0
    for m in model.modules():
        if hasattr(m, "lora_A") and "default" in m.lora_A:
            a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
            assert a.shape[0] == b.shape[1]
            total += a.shape[0] * (a.shape[1] + b.shape[0])
    return total


def numel(params):
    return sum(p.numel() for p in params)


def optimizer_params(opt):
    return [p for group in opt.param_groups for p in group["params"]]


def perturb_adapters(model, seed=0):
    """Give every LoRA B random values, so the adapted model differs from its base."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


# --- config ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, match",
    [
        ({"lora_rank": -1}, "lora_rank must be >= 0"),
        ({"lora_rank": 4, "lora_alpha": 0}, "lora_alpha must be > 0"),
        ({"lora_dropout": 1.0}, r"lora_dropout must be in \[0, 1\)"),
        ({"lora_target_modules": []}, "non-empty list"),
        ({"lora_target_modules": ["q_proj", 3]}, "non-empty list"),
        ({"lora_target_modules": " "}, "lora_target_modules must be"),
        ({"lora_target_modules": 5}, "lora_target_modules must be"),
    ],
)
@pytest.mark.parametrize("cls", [reinforce.ReinforceConfig, ppo.PPOConfig, ilql.ILQLConfig])
def test_config_errors(cls, values, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(cls, values)


def test_config_defaults_and_overrides():
    cfg = reinforce.ReinforceConfig()
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules, cfg.lora) == (
        0, None, 0.0, None, False
    )
    cfg = load_config(
        ppo.PPOConfig, None, ["lora_rank=8", "lora_alpha=32", "lora_target_modules=[c_attn, c_fc]"]
    )
    assert cfg.lora and cfg.lora_alpha == 32.0 and cfg.lora_target_modules == ["c_attn", "c_fc"]
    assert (
        load_config(ilql.ILQLConfig, None, ["lora_target_modules=.*attn.*"]).lora_target_modules == ".*attn.*"
    )


# --- adapters on a model --------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_apply_lora_starts_at_the_base_and_disabling_gives_the_base_back(arch):
    base = tiny_causal_lm(arch, V, seed=0)
    model = apply_lora(copy.deepcopy(base), rank=4)
    assert type(model) is type(base) and is_lora(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert numel(trainable) == lora_numel(model) > 0
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    x = torch.randint(3, V, (3, 7))
    with torch.no_grad():
        want = base(x).logits
        assert torch.equal(model(x).logits, want)  # B = 0 at init
        perturb_adapters(model)
        assert (model(x).logits - want).abs().max() > 1e-2
        with adapters_disabled(model):
            assert torch.equal(model(x).logits, want)
        assert (model(x).logits - want).abs().max() > 1e-2  # enabled again


def test_adapters_come_back_after_an_error():
    model = apply_lora(tiny_causal_lm("llama", V, seed=0), rank=2)
    with pytest.raises(RuntimeError, match="boom"), adapters_disabled(model):
        raise RuntimeError("boom")
    assert not any(m.disable_adapters for m in model.modules() if hasattr(m, "lora_A"))


def test_gpt2_conv1d_layers_get_fan_in_fan_out_and_targets_are_checked():
    model = apply_lora(tiny_causal_lm("gpt2", V, seed=0), rank=2, target_modules=["c_attn"])
    adapted = [n for n, m in model.named_modules() if hasattr(m, "lora_A")]
    assert adapted == ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"]
    assert all(m.fan_in_fan_out for m in model.modules() if hasattr(m, "lora_A"))
    with pytest.raises(ValueError, match=r"match no layer.*c_attn"):
        apply_lora(tiny_causal_lm("gpt2", V, seed=0), rank=2, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="already holds LoRA"):
        apply_lora(model, rank=2)
    with pytest.raises(ValueError, match="rank must be"):
        apply_lora(tiny_causal_lm("gpt2", V, seed=0), rank=0)


def test_the_seed_fixes_the_adapters():
    a = apply_lora(tiny_causal_lm("llama", V, seed=0), rank=2, seed=3).state_dict()
    b = apply_lora(tiny_causal_lm("llama", V, seed=0), rank=2, seed=3).state_dict()
    c = apply_lora(tiny_causal_lm("llama", V, seed=0), rank=2, seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if "lora_A" in k)


def test_share_frozen_parameters_ties_only_equal_frozen_weights():
    from rlbits.models.lora import share_frozen_parameters

    a = apply_lora(tiny_causal_lm("llama", V, seed=0), rank=2, seed=1)
    b = apply_lora(tiny_causal_lm("llama", V, seed=0), rank=2, seed=2)
    with torch.no_grad():
        b.model.norm.weight.add_(1.0)  # a frozen weight that differs: kept
    frozen = {n for n, p in b.named_parameters() if not p.requires_grad and n != "model.norm.weight"}
    assert share_frozen_parameters(b, a) == numel(p for n, p in b.named_parameters() if n in frozen)
    mine, theirs = dict(b.named_parameters()), dict(a.named_parameters())
    assert all(mine[n] is theirs[n] for n in frozen)
    assert mine["model.norm.weight"] is not theirs["model.norm.weight"]
    assert all(mine[n] is not theirs[n] for n in mine if "lora_" in n)  # adapters stay their own


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_export_merges_the_adapters_into_a_plain_folder(arch, tmp_path):
    model = apply_lora(tiny_causal_lm(arch, V, seed=0), rank=4, alpha=16.0)
    perturb_adapters(model)
    export_model(model, tmp_path / "final", tokenizer=tiny_tokenizer(V))
    assert is_lora(model)  # the run's model keeps its adapters
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert not is_lora(loaded) and not any("lora" in k or "base_layer" in k for k in loaded.state_dict())
    x = torch.randint(3, V, (3, 9))
    with torch.no_grad():
        assert torch.allclose(loaded(x).logits, model(x).logits, atol=1e-5, rtol=0)
        assert torch.allclose(merge_lora(copy.deepcopy(model))(x).logits, model(x).logits, atol=1e-5, rtol=0)


# --- the loops' states ----------------------------------------------------------------------------------


def storage_bytes(*models) -> int:
    """Bytes of the distinct parameter storages of ``models`` (None skipped)."""
    seen = {}
    for model in models:
        for p in model.parameters() if model is not None else ():
            s = p.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("loop", ["reinforce", "ppo"])
def test_reference_is_the_policy_with_adapters_disabled_and_no_second_copy(loop, tiny_path, tmp_path):
    cfg = make_cfg(loop, tiny_path, tmp_path / "run")
    module = reinforce if loop == "reinforce" else ppo
    env = setup(cfg)
    state = module.init_state(cfg, env, reward=length_reward, prompts=PROMPTS)
    full = module.init_state(
        dataclasses.replace(cfg, lora_rank=0), env, reward=length_reward, prompts=PROMPTS
    )
    base = load_policy(tiny_path)
    base_bytes = numel(base.parameters()) * 4
    assert state.reference is None and full.reference is not None
    # no second copy: with LoRA, policy, reference and PPO's critic hold the base weights once (the adapters
    # and the value head add < 20%); full fine-tuning holds a copy for each
    models = lambda s: (s.policy, s.reference, getattr(s, "value_model", None))  # noqa: E731
    own = lora_numel(state.policy)
    if loop == "ppo":
        own += lora_numel(state.value_model) + numel(state.value_model.head.parameters())
    assert storage_bytes(*models(state)) == base_bytes + 4 * own
    assert storage_bytes(*models(full)) > (2.9 if loop == "ppo" else 1.9) * base_bytes

    batch = module.rollout(state, prompt_batch(PROMPTS[:4]), cfg)
    with torch.no_grad():
        want = policy_logprobs(base, batch)
        assert torch.allclose(policy_logprobs(state.policy, batch), want, atol=1e-6)  # LoRA B = 0 at init
        assert torch.allclose(batch["logprobs"], want, atol=1e-5)  # generate runs the adapted model
    perturb_adapters(state.policy)
    module.reference(state, batch, cfg)
    assert torch.allclose(batch["ref_logprobs"], want, atol=1e-6)
    with torch.no_grad():
        assert (policy_logprobs(state.policy, batch) - want).abs().max() > 1e-3  # adapters on again
    with reference_model(state) as ref:
        assert ref is state.policy


def test_optimizers_hold_only_adapters_and_heads(tiny_path, tmp_path):
    env = setup(make_cfg("ppo", tiny_path, tmp_path / "p"))
    s = ppo.init_state(make_cfg("ppo", tiny_path, tmp_path / "p"), env, reward=length_reward, prompts=PROMPTS)
    assert numel(optimizer_params(s.policy_optimizer)) == lora_numel(s.policy) > 0
    head = numel(s.value_model.head.parameters())
    assert numel(optimizer_params(s.value_optimizer)) == lora_numel(s.value_model.backbone) + head
    assert all(p.requires_grad for p in s.value_model.head.parameters())
    assert numel(p for p in s.value_model.backbone.parameters() if p.requires_grad) == lora_numel(
        s.value_model
    )
    policy_a = {n: p for n, p in s.policy.named_parameters() if "lora_A" in n}
    critic_a = {n: p for n, p in s.value_model.backbone.named_parameters() if "lora_A" in n}
    assert not torch.equal(next(iter(policy_a.values())), next(iter(critic_a.values())))  # own adapters

    cfg = make_cfg("ilql", tiny_path, tmp_path / "i")
    s = ilql.init_state(cfg, env, reward=length_reward)
    heads = [s.model.q1, s.model.q2, s.model.v]
    assert numel(optimizer_params(s.optimizer)) == lora_numel(s.model.policy) + numel(
        p for h in heads for p in h.parameters()
    )
    assert all(p.requires_grad for h in heads for p in h.parameters())
    assert not any(p.requires_grad for p in s.model.target_q1.parameters())


# --- runs (slow) ----------------------------------------------------------------------------------------


def _checkpoint_model(loop, cfg, run_dir):
    """The run's last checkpoint loaded into a fresh model with adapters: (name, model, lm)."""
    if loop == "ilql":
        model = ilql._fresh_model(cfg)[0]
        name, lm = "model", lambda m: m.policy
    else:
        model = build_policy(cfg)
        name, lm = "policy", lambda m: m
    load_checkpoint(latest_checkpoint(run_dir), models={name: model})
    return lm(model)


@pytest.mark.slow
@pytest.mark.parametrize("loop", list(LOOPS))
def test_each_loop_trains_adapters_and_exports_them_merged(loop, tiny_path, tmp_path):
    # PPO also samples from the reference (reward_subtract_reference) and recomputes activations
    extra = dict(activation_checkpointing=True, reward_subtract_reference=True) if loop == "ppo" else {}
    cfg = make_cfg(loop, tiny_path, tmp_path / "run", **extra)
    kw = {"prompts": PROMPTS} if loop != "ilql" else {}
    run_dir = LOOPS_MODULES[loop].train(cfg, reward=length_reward, **kw)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2] and all(v == v for r in rows for v in r.values())
    trained = _checkpoint_model(loop, cfg, run_dir)
    base = load_policy(tiny_path)
    if loop == "ilql":  # its model comes from the loops' loader, which fuses GPT-2's GELU (other rounding)
        base = fused_gelu(base)
    x = torch.randint(3, V, (3, 9))
    with torch.no_grad():
        final = AutoModelForCausalLM.from_pretrained(run_dir / "final")(x).logits
        assert torch.allclose(final, trained(x).logits, atol=1e-5, rtol=0)
        assert (final - base(x).logits).abs().max() > 1e-4  # the adapters trained
        with adapters_disabled(trained):  # ... and the base weights did not move
            assert torch.equal(trained(x).logits, base(x).logits)


LOOPS_MODULES = {"reinforce": reinforce, "ppo": ppo, "ilql": ilql}


@pytest.mark.slow
@pytest.mark.parametrize("loop", list(LOOPS))
def test_lora_resume_reproduces_the_uninterrupted_run(loop, tiny_path, tmp_path):
    module = LOOPS_MODULES[loop]
    opts = dict(save_period=2, val_at_start=False, val_period=0, val_at_end=False)
    kw = {"prompts": PROMPTS} if loop != "ilql" else {}
    full = module.train(
        make_cfg(loop, tiny_path, tmp_path / "a", max_num_steps=4, **opts), reward=length_reward, **kw
    )
    part = make_cfg(loop, tiny_path, tmp_path / "b", **opts)
    module.train(part, reward=length_reward, **kw)
    resumed = module.train(
        dataclasses.replace(part, max_num_steps=4), reward=length_reward, resume=True, **kw
    )

    assert (
        untimed_by_step(read_metrics(full), 3) == untimed_by_step(read_metrics(resumed), 3)
        and len(untimed_by_step(read_metrics(full), 3)) == 2
    )
    a = load_policy(full / "final").state_dict()
    b = load_policy(resumed / "final").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _run(cmd: list[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]


@pytest.mark.slow
def test_one_lora_update_on_two_fsdp_ranks_equals_one_process(tmp_path):
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    _run([sys.executable, "tests/lora_worker.py", str(one)])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    _run([*torchrun, "tests/lora_worker.py", str(two)])
    a, b = torch.load(one, weights_only=True), torch.load(two, weights_only=True)
    assert a.keys() == b.keys() and any("lora_B" in k for k in a)
    # Adam's first step divides each gradient entry by its own size, so the two reduction orders' rounding
    # in an entry near Adam's eps shows at up to lr x 1e-4 = 5e-6 (seen on an AVX-512 AMD machine).
    for k in a:
        assert torch.allclose(a[k], b[k], atol=2e-5, rtol=1e-5), k
    base = tiny_causal_lm("gpt2", 48, seed=0).state_dict()  # the worker's V = 48: the base did not move
    assert all(torch.equal(a[k], base[k.replace(".base_layer", "")]) for k in a if "lora_" not in k)
    for out in (one, two):  # the reference is the base model, sharded or not
        ref = torch.load(out.with_suffix(".ref.pt"), weights_only=True)
        assert torch.allclose(ref["ref"], ref["base"], atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("loop", list(LOOPS))
def test_torchrun_two_ranks_runs_each_loop_with_lora(loop, tiny_path, tmp_path):
    configs = {"ppo": "ppo_sentiment", "reinforce": "rloo_arithmetic", "ilql": "ilql_sentiment"}
    extra = {
        "ppo": [
            "num_prompts_per_step=4",
            "num_generations_per_prompt=2",
            "microbatch_size=4",
            "num_minibatches=2",
        ],
        "reinforce": ["num_prompts_per_step=2", "num_generations_per_prompt=4", "microbatch_size=4"],
        "ilql": ["batch_size=4", "microbatch_size=2", "dataset_size=16", "dataset_batch_size=8"],
    }[loop]
    run_dir = tmp_path / "run"
    common = ["max_num_steps=2", "max_new_tokens=5", "max_val_samples=4", "progress=false", "tensorboard=false",
              "save_period=1", "val_period=0", "task=arithmetic", "lora_rank=4"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    _run(
        [
            *torchrun,
            "-m",
            "rlbits",
            "train",
            f"configs/{configs[loop]}.yaml",
            f"policy={tiny_path}",
            f"run_dir={run_dir}",
            *common,
            *extra,
        ]
    )
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert not any("lora" in k for k in final.state_dict())
