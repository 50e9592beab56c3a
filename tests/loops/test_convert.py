"""``rlbits convert-config``: configs of each seed's structure (written here, with the field names of the
seeds' example configs) convert with only infrastructure refused, the rlbits config trains 2 steps on a tiny
model, bad input is refused naming the field, and docs/seeds.md's tables are the converter's rules."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from rlbits.cli import main
from rlbits.loops.convert import RULES, convert, finish, seed_tables, seed_totals_table
from rlbits.loops.convert_read import read_seed_config
from rlbits.models.load import save_pretrained
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

DOC = Path(__file__).resolve().parents[2] / "docs" / "seeds.md"

NEMO_RL_BASE = """
cluster: {gpus_per_node: 1, num_nodes: 1}
logger: {log_dir: logs, wandb_enabled: false, tensorboard_enabled: false, wandb: {project: p, name: n}}
"""

NEMO_RL_PPO = """
defaults: base.yaml
ppo:
  num_prompts_per_step: 4
  num_generations_per_prompt: 2
  max_rollout_turns: 1
  max_num_epochs: 1
  max_num_steps: 10
  ppo_epochs: 2
  policy_training_start_step: 0
  val_period: 5
  val_at_start: false
  val_at_end: false
  overlong_filtering: true
  max_val_samples: 8
  val_batch_size: 8
  seed: 3
  use_dynamic_sampling: false
  dynamic_sampling_max_gen_batches: 10
  batch_multiplier: 1
  skip_reference_policy_logprobs_calculation: false
  async_ppo: {enabled: false, max_trajectory_age_steps: 1}
  reward_shaping:
    enabled: true
    overlong_buffer_length: 2
    overlong_buffer_penalty: 0.5
    max_response_length: ${policy.generation.max_new_tokens}
    stop_properly_penalty_coef: null
  adv_estimator: {name: gae, gae_lambda: 0.9, gae_gamma: 1, normalize_advantages: true, gae_lambda_value: null,
                  gae_lambda_policy: null, length_adaptive_alpha: 0.0}
  reward_scaling: {enabled: false, source_min: 0.0, source_max: 1.0, target_min: -1.0, target_max: 1.0}
  seq_logprob_error_threshold: null
loss_fn:
  reference_policy_kl_penalty: 0.01
  reference_policy_kl_type: k3
  kl_input_clamp_value: 20.0
  kl_output_clamp_value: 10.0
  ratio_clip_min: 0.2
  ratio_clip_max: 0.28
  ratio_clip_c: null
  use_on_policy_kl_approximation: false
  use_importance_sampling_correction: false
  truncated_importance_sampling_type: null
  truncated_importance_sampling_ratio: null
  sequence_level_importance_ratios: false
  token_level_loss: true
  use_kl_in_reward: false
  positive_example_nll_weight: 0.0
value_loss_fn: {scale: 0.5, cliprange: 0.2}
checkpointing: {enabled: true, checkpoint_dir: results/ppo, metric_name: "val:accuracy", higher_is_better: true,
                keep_top_k: 2, save_period: 10, checkpoint_must_save_by: null}
policy:
  model_name: Qwen/Qwen2.5-0.5B
  tokenizer: {name: "${policy.model_name}"}
  train_global_batch_size: 4
  train_micro_batch_size: 2
  logprob_batch_size: ${policy.train_micro_batch_size}
  max_total_sequence_length: 64
  precision: float32
  dtensor_cfg: {enabled: true, tensor_parallel_size: 1, activation_checkpointing: false,
                lora_cfg: {enabled: false, dim: 8, alpha: 32}}
  megatron_cfg: {enabled: false, tensor_model_parallel_size: 1, optimizer: {lr: 1.0e-6}}
  max_grad_norm: 1.0
  optimizer: {name: torch.optim.AdamW, kwargs: {lr: 1.0e-4, weight_decay: 0.0, betas: [0.9, 0.98], eps: 1e-6}}
  scheduler:
  - {name: torch.optim.lr_scheduler.LinearLR, kwargs: {start_factor: 0.1, end_factor: 1.0, total_iters: 3}}
  - {name: torch.optim.lr_scheduler.ConstantLR, kwargs: {factor: 1.0, total_iters: 10000000000}}
  - {milestones: [3]}
  generation:
    backend: vllm
    max_new_tokens: 4
    temperature: 1.0
    top_p: 1.0
    top_k: null
    val_temperature: ${.temperature}
    val_top_p: 0.9
    val_top_k: ${.top_k}
    stop_token_ids: null
    stop_strings: null
    vllm_cfg: {tensor_parallel_size: 1, gpu_memory_utilization: 0.6, max_model_len: "${mul:2, 32}"}
value:
  model_name: ${policy.model_name}
  train_global_batch_size: ${policy.train_global_batch_size}
  train_micro_batch_size: ${policy.train_micro_batch_size}
  precision: float32
  optimizer: {name: torch.optim.AdamW, kwargs: {lr: 2.0e-4, weight_decay: 0.1, betas: [0.9, 0.98], eps: 1e-6}}
  scheduler:
  - {name: torch.optim.lr_scheduler.LinearLR, kwargs: {start_factor: 0.05, end_factor: 1.0, total_iters: 2}}
  - {name: torch.optim.lr_scheduler.ConstantLR, kwargs: {factor: 1.0, total_iters: 10000000000}}
  - milestones: [2]
data: {max_input_seq_length: 32, shuffle: true, train: {dataset_name: OpenMathInstruct-2}}
env: {math: {num_workers: 8}}
"""

NEMO_RL_GRPO = """
grpo:
  num_prompts_per_step: 2
  num_generations_per_prompt: 4
  max_num_steps: 10
  normalize_rewards: true
  use_leave_one_out_baseline: true
  val_period: 0
  val_at_start: false
  val_at_end: false
  seed: 1
  use_dynamic_sampling: false
  batch_multiplier: 1
  adv_estimator: {name: grpo, normalize_rewards: "${grpo.normalize_rewards}",
                  use_leave_one_out_baseline: "${grpo.use_leave_one_out_baseline}", minus_baseline: true}
loss_fn: {reference_policy_kl_penalty: 0.04, reference_policy_kl_type: k3, ratio_clip_min: 0.2, ratio_clip_max: 0.2,
          token_level_loss: true, use_kl_in_reward: false}
policy:
  model_name: Qwen/Qwen2.5-1.5B
  train_global_batch_size: 8
  train_micro_batch_size: 4
  optimizer: {name: torch.optim.AdamW, kwargs: {lr: 5.0e-6, weight_decay: 0.01}}
  generation: {max_new_tokens: 4, temperature: 1.0}
cluster: {gpus_per_node: 1}
"""

ALIGNER_ACTOR = """
defaults:
  - optional tp_overlap@model.ub_tp_comm_overlap_cfg:
trainer:
  num_nodes: 1
  devices: 1
  precision: 32
  ppo:
    critic_warmup_steps: 0
    max_epochs: 1
    max_steps: -1
    val_check_interval: 10
    save_interval: ${.val_check_interval}
    gradient_clip_val: 1.0
    initial_policy_kl_penalty: 0.01
    use_absolute_kl: true
    discount_factor: 1.0
    gae_lambda: 0.95
    normalize_advantages: true
    trt_llm: {enable: false, max_input_len: "${subtract:${model.encoder_seq_length}, ${model.ppo.length_params.max_length}}"}
    model_gbs: ${model.global_batch_size}
  max_steps: ${.ppo.max_steps}
remote_critic_rm:
  pad_to_length: ${model.encoder_seq_length}
  combine_rm_and_critic_server: true
  critic: {name: {train: critic_train}, ip: localhost, port: 5556}
exp_manager:
  explicit_log_dir: /results
  create_wandb_logger: false
  checkpoint_callback_params: {monitor: val_rewards, save_top_k: 1, mode: max,
                               model_parallel_size: "${multiply:${model.tensor_model_parallel_size}, 1}"}
pretrained_checkpoint: {restore_from_path: null}
model:
  ppo:
    rollout_micro_batch_size: 2
    num_rollout_samples: 4
    forward_micro_batch_size: ${.rollout_micro_batch_size}
    val_rollout_micro_batch_size: ${.rollout_micro_batch_size}
    num_val_samples: ${.num_rollout_samples}
    entropy_bonus: 0.0
    ratio_eps: 0.2
    sampling_params: {use_greedy: false, temperature: 1.0, top_k: 0, top_p: 1.0, repetition_penalty: 1.0,
                      add_BOS: false, end_strings: ["<|endoftext|>", "<extra_id_1>"]}
    length_params: {max_length: "${int_div:${model.encoder_seq_length}, 8}", min_length: 1}
  peft: {peft_scheme: none, lora_tuning: {adapter_dim: 32, target_modules: [attention_qkv]}}
  micro_batch_size: 2
  global_batch_size: 2
  encoder_seq_length: 32
  seed: 1234
  optim:
    name: distributed_fused_adam
    lr: 9e-5
    weight_decay: 0.0
    betas: [0.9, 0.98]
    eps: 1.0e-6
    sched: {name: CosineAnnealing, warmup_steps: 1, constant_steps: 1, min_lr: 9e-6, max_steps: 10}
  precision: ${trainer.precision}
"""

ALIGNER_CRITIC = """
trainer:
  devices: 1
  ppo: {port: 5556, combine_rm_and_critic_server: true, max_steps: 10, gradient_clip_val: 1.0}
model:
  loss_clip_val: 0.2
  output_sequence: true
  reward_standardization: {enable: false, mean: null, std: null}
  micro_batch_size: 2
  global_batch_size: 2
  optim: {name: distributed_fused_adam, lr: 9e-4, weight_decay: 0.01, betas: [0.9, 0.98],
          sched: {name: CosineAnnealing, warmup_steps: 1, constant_steps: 1, min_lr: 9e-6}}
"""

ALIGNER_REINFORCE = (
    ALIGNER_ACTOR.replace("  ppo:\n    critic_warmup_steps: 0\n", "  reinforce:\n    num_rollouts_per_prompt: 2\n")
    .replace("    discount_factor: 1.0\n    gae_lambda: 0.95\n    normalize_advantages: true\n", "")
    .replace("model.ppo.", "model.reinforce.")
    .replace(".ppo.max_steps", ".reinforce.max_steps")
    .replace("remote_critic_rm:", "remote_rm:")
    .replace("  ppo:\n    rollout_micro_batch_size", "  reinforce:\n    rollout_micro_batch_size")
    .replace("    entropy_bonus: 0.0\n    ratio_eps: 0.2\n", "")
    .replace("  global_batch_size: 2\n  encoder", "  global_batch_size: 8\n  encoder")
)

TRLX_PPO = """
train: {seq_length: 64, epochs: 1, total_steps: 8, batch_size: 2, checkpoint_interval: 100, eval_interval: 4,
        pipeline: PromptPipeline, trainer: AcceleratePPOTrainer, tracker: null, checkpoint_dir: ckpts, seed: 5}
model: {model_path: lvwerra/gpt2-imdb, num_layers_unfrozen: 1}
tokenizer: {tokenizer_path: gpt2, truncation_side: right}
optimizer: {name: adamw, kwargs: {lr: 3.0e-5, betas: [0.9, 0.95], eps: 1.0e-8, weight_decay: 1.0e-6}}
scheduler: {name: cosine_annealing, kwargs: {T_max: 1000000000000.0, eta_min: 3.0e-5}}
method:
  name: PPOConfig
  num_rollouts: 4
  chunk_size: 4
  ppo_epochs: 2
  init_kl_coef: 0.001
  target: null
  horizon: 10000
  gamma: 1
  lam: 0.95
  cliprange: 0.2
  cliprange_value: 0.2
  vf_coef: 1
  scale_reward: ignored
  ref_mean: null
  ref_std: null
  cliprange_reward: 10
  gen_kwargs: {max_new_tokens: 4, top_k: 0, top_p: 1.0, do_sample: true}
"""

TRLX_ILQL = """
train: {seq_length: 64, batch_size: 4, epochs: 1, total_steps: 10, checkpoint_interval: 10, eval_interval: 5,
        pipeline: PromptPipeline, trainer: AccelerateILQLTrainer}
model: {model_path: gpt2, num_layers_unfrozen: -1}
tokenizer: {tokenizer_path: gpt2, truncation_side: right}
optimizer: {name: adamw, kwargs: {lr: 5.0e-5, betas: [0.9, 0.999], eps: 1.0e-8, weight_decay: 1.0e-6}}
scheduler: {name: cosine_annealing, kwargs: {T_max: 1000000000000.0, eta_min: 5.0e-5}}
method: {name: ilqlconfig, tau: 0.7, gamma: 0.99, cql_scale: 0.1, awac_scale: 1, alpha: 0.001, beta: 0,
         steps_for_target_q_sync: 5, two_qs: true, gen_kwargs: {max_new_tokens: 4, top_k: 20, beta: 1, temperature: 1.0}}
"""

CASES = {
    "nemo-rl-ppo": ("nemo-rl", {"base.yaml": NEMO_RL_BASE, "ppo.yaml": NEMO_RL_PPO}),
    "nemo-rl-grpo": ("nemo-rl", {"grpo.yaml": NEMO_RL_GRPO}),
    "nemo-aligner-ppo": ("nemo-aligner", {"gpt_ppo_actor.yaml": ALIGNER_ACTOR, "gpt_ppo_critic.yaml": ALIGNER_CRITIC}),
    "nemo-aligner-reinforce": ("nemo-aligner", {"gpt_reinforce_actor.yaml": ALIGNER_REINFORCE}),
    "trlx-ppo": ("trlx", {"ppo_config.yml": TRLX_PPO}),
    "trlx-ilql": ("trlx", {"ilql_config.yml": TRLX_ILQL}),
}


def write(tmp_path: Path, files: dict[str, str]) -> list[str]:
    """The case's files under tmp_path; the files to convert (NeMo-RL's defaults file is included, not given)."""
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    return [str(tmp_path / n) for n in files if n != "base.yaml"]


def run_convert(capsys, seed: str, paths: list[str], out: Path) -> tuple[int, str]:
    code = main(["convert-config", "--from", seed, *paths, "-o", str(out)])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("case", list(CASES))
def test_structure_converts_with_only_infrastructure_refused(case, tmp_path, capsys):
    seed, files = CASES[case]
    code, out = run_convert(capsys, seed, write(tmp_path, files), tmp_path / "out.yaml")
    refused = [line for line in out.splitlines() if line.startswith("  refused: ")]
    assert code == 0, out
    assert all(": infrastructure: " in line for line in refused), refused
    assert yaml.safe_load((tmp_path / "out.yaml").read_text())["loop"] in ("ppo", "reinforce", "ilql")


def converted(tmp_path, capsys, case) -> dict:
    seed, files = CASES[case]
    code, out = run_convert(capsys, seed, write(tmp_path, files), tmp_path / "out.yaml")
    assert code == 0, out
    return yaml.safe_load((tmp_path / "out.yaml").read_text())


def test_nemo_rl_ppo_fields(tmp_path, capsys):
    v = converted(tmp_path, capsys, "nemo-rl-ppo")
    assert v["loop"] == "ppo" and v["policy"] == "Qwen/Qwen2.5-0.5B" and v["critic_init"] == "policy"
    assert (v["lam"], v["gamma"], v["vf_coef"], v["value_clip_eps"]) == (0.9, 1.0, 0.5, 0.2)
    assert (v["overlong_buffer_length"], v["overlong_buffer_penalty"], v["max_response_length"]) == (2, 0.5, 4)
    assert (v["kl_in_reward"], v["kl_loss_coef"], v["kl_estimator"], v["clip_eps_high"]) == (False, 0.01, "k3", 0.28)
    assert (v["lr_scheduler"], v["lr_warmup_steps"], v["lr_warmup_start_factor"]) == ("linear_warmup", 3, 0.1)
    assert (v["num_minibatches"], v["microbatch_size"], v["critic_learning_rate"]) == (2, 2, 2e-4)
    assert v["val_generation"] == {"top_p": 0.9} and v["metric_name"] == "val_reward" and v["keep_top_k"] == 2
    assert "batch_multiplier" not in v or v["batch_multiplier"] == 1
    assert (v["adam_betas"], v["adam_eps"], v["critic_weight_decay"]) == ([0.9, 0.98], 1e-6, 0.1)
    assert (v["critic_lr_warmup_steps"], v["critic_lr_warmup_start_factor"]) == (2, 0.05)


def test_nemo_rl_grpo_and_aligner_and_trlx_fields(tmp_path, capsys):
    (tmp_path / "g").mkdir()
    g = converted(tmp_path / "g", capsys, "nemo-rl-grpo")
    assert (g["loop"], g["adv_estimator"], g["kl_loss_coef"], g["kl_loss_estimator"]) == ("reinforce", "grpo_loo", 0.04, "k3")
    (tmp_path / "a").mkdir()
    a = converted(tmp_path / "a", capsys, "nemo-aligner-ppo")
    assert (a["kl_coef"], a["kl_estimator"], a["lr_scheduler"], a["lr_constant_steps"]) == (0.01, "abs", "cosine", 1)
    assert (a["critic_learning_rate"], a["value_clip_eps"], a["max_new_tokens"], a["top_k"]) == (9e-4, 0.2, 4, None)
    assert a["stop_strings"] == ["<extra_id_1>"] and a["save_period"] == 10 and a["num_minibatches"] == 2
    assert (a["adam_betas"], a["adam_eps"], a["weight_decay"], a["critic_weight_decay"]) == ([0.9, 0.98], 1e-6, 0.0, 0.01)
    (tmp_path / "r").mkdir()
    r = converted(tmp_path / "r", capsys, "nemo-aligner-reinforce")
    assert (r["loop"], r["adv_estimator"], r["rloo_exclude_truncated"], r["kl_reward_reduction"]) == (
        "reinforce", "rloo", True, "mean")
    (tmp_path / "t").mkdir()
    t = converted(tmp_path / "t", capsys, "trlx-ppo")
    # trlx counts optimizer steps: 8 / (ppo_epochs 2 * 4 rollouts / batch 2) = 2 rlbits steps
    assert (t["max_num_steps"], t["num_minibatches"], t["val_period"], t["reward_clip"]) == (2, 2, 1, 10.0)
    assert (t["lr_scheduler"], t["lr_max_steps"], t["min_lr"], t["num_layers_unfrozen"]) == (
        "cosine_annealing", 10**12, 3e-5, 1)
    assert (t["adam_betas"], t["adam_eps"]) == ([0.9, 0.95], 1e-8)
    (tmp_path / "i").mkdir()
    i = converted(tmp_path / "i", capsys, "trlx-ilql")
    assert (i["loop"], i["awac_beta"], i["beta"], i["top_k"], i["standardize_rewards"]) == ("ilql", 0.0, 1.0, 20, True)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_converted_config_trains_two_steps(case, tmp_path, capsys, monkeypatch):
    seed, files = CASES[case]
    src = tmp_path / "src"
    src.mkdir()
    code, out = run_convert(capsys, seed, write(src, files), tmp_path / "out.yaml")
    assert code == 0, out
    policy = tmp_path / "policy"
    save_pretrained(tiny_causal_lm("gpt2", seed=0), tiny_tokenizer(), policy)
    monkeypatch.setenv("RLBITS_CACHE", str(tmp_path / "cache"))
    small = [
        f"policy={policy}", f"run_dir={tmp_path / 'run'}", "task=sentiment", "max_num_steps=2", "max_new_tokens=4",
        "val_period=0", "val_at_start=false", "val_at_end=false", "max_val_samples=2", "save_period=0",
        "progress=false", "tensorboard=false", "keep_top_k=null", "max_time=null",
    ]
    loop = yaml.safe_load((tmp_path / "out.yaml").read_text())["loop"]
    if loop == "ilql":
        small += ["dataset_size=8", "dataset_batch_size=8", "batch_size=4", "microbatch_size=4"]
    else:
        small += ["num_prompts_per_step=2", "num_minibatches=1", "microbatch_size=2", "chunk_size=null",
                  "val_batch_size=null", "min_new_tokens=0", "max_response_length=null"]
    assert main(["train", str(tmp_path / "out.yaml"), *small]) == 0
    assert (tmp_path / "run" / "final").is_dir()


# --------------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------------


def test_unknown_seed_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["convert-config", "--from", "verl", str(tmp_path / "x.yaml")])
    assert e.value.code == 2 and "invalid choice: 'verl'" in capsys.readouterr().err


@pytest.mark.parametrize("text,message", [("a: [1, 2\n", "x.yaml"), ("- 1\n- 2\n", "must hold a mapping")])
def test_unreadable_yaml_is_refused(tmp_path, capsys, text, message):
    (tmp_path / "x.yaml").write_text(text)
    assert main(["convert-config", "--from", "nemo-rl", str(tmp_path / "x.yaml")]) == 2
    assert message in capsys.readouterr().err


def test_missing_file_is_refused(tmp_path, capsys):
    assert main(["convert-config", "--from", "trlx", str(tmp_path / "none.yml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_unknown_field_is_listed_not_dropped(tmp_path, capsys):
    text = NEMO_RL_GRPO + "grpo_extra: {frobnicate: 3}\n"
    (tmp_path / "g.yaml").write_text(text.replace("  seed: 1\n", "  seed: 1\n  my_new_knob: 0.5\n"))
    code, out = run_convert(capsys, "nemo-rl", [str(tmp_path / "g.yaml")], tmp_path / "out.yaml")
    assert code == 1
    assert "refused: grpo.my_new_knob: unknown field" in out and "refused: grpo_extra.frobnicate: unknown field" in out


def test_unsupported_value_and_unresolvable_interpolation_name_the_field(tmp_path, capsys):
    text = ALIGNER_ACTOR.replace("betas: [0.9, 0.98]", "betas: [0.9, 1.5]").replace(
        "min_length: 1", "min_length: '${model.nowhere}'"
    )
    (tmp_path / "a.yaml").write_text(text)
    code, out = run_convert(capsys, "nemo-aligner", [str(tmp_path / "a.yaml")], tmp_path / "out.yaml")
    assert code == 1
    assert "refused: model.optim.betas: not supported: Adam betas [0.9, 1.5]" in out
    assert "refused: model.ppo.length_params.min_length: not supported: unresolvable interpolation" in out


@pytest.mark.parametrize("nested", [True, False], ids=["adv_estimator", "older_top_level_flags"])
@pytest.mark.parametrize(
    ("norm", "loo", "want"),
    [(True, True, "grpo_loo"), (True, False, "grpo"), (False, True, "rloo"), (False, False, "dr_grpo")],
)
def test_nemo_rl_grpo_flags_pick_the_estimator(nested, norm, loo, want, tmp_path):
    text = NEMO_RL_GRPO.replace("normalize_rewards: true\n", f"normalize_rewards: {str(norm).lower()}\n").replace(
        "use_leave_one_out_baseline: true\n", f"use_leave_one_out_baseline: {str(loo).lower()}\n"
    )
    if not nested:  # NeMo-RL before grpo.adv_estimator: grpo.py read the two flags
        text = text.replace(text[text.index("  adv_estimator:"): text.index("loss_fn:")], "")
    conv = convert("nemo-rl", write(tmp_path, {"grpo.yaml": text}))
    assert conv.values["adv_estimator"] == want and conv.ok, conv.refused


def test_nemo_rl_megatron_value_model_optimizer(tmp_path):
    """The value model's Megatron weight decay (its scheduler's start/end, which Megatron applies each step)
    and warm-up (``lr_warmup_iters``, ``lr_warmup_init / lr``) map to the critic's fields."""
    megatron = (
        "  megatron_cfg:\n    enabled: true\n    optimizer: {lr: LR, weight_decay: 0.01, adam_beta1: 0.9, adam_beta2: 0.98,"
        " adam_eps: 1.0e-6}\n    scheduler: {lr_decay_style: constant, lr_warmup_iters: ITERS, lr_warmup_init: INIT,"
        " start_weight_decay: WD, end_weight_decay: WD, weight_decay_incr_style: constant}\n"
    )
    policy = "  megatron_cfg: {enabled: false, tensor_model_parallel_size: 1, optimizer: {lr: 1.0e-6}}\n"
    text = NEMO_RL_PPO.replace(policy, megatron.replace(
        "LR", "1.0e-4").replace("ITERS", "3").replace("INIT", "1.0e-5").replace("WD", "0.01"), 1)
    text = text.replace("  model_name: ${policy.model_name}\n", "  model_name: ${policy.model_name}\n" + megatron.replace(
        "LR", "2.0e-4").replace("ITERS", "5").replace("INIT", "1.0e-5").replace("WD", "0.1"), 1)
    conv = convert("nemo-rl", write(tmp_path, {"base.yaml": NEMO_RL_BASE, "ppo.yaml": text}))
    v = conv.values
    assert (v["weight_decay"], v["critic_weight_decay"], v["adam_betas"], v["adam_eps"]) == (0.01, 0.1, [0.9, 0.98], 1e-6)
    assert (v["lr_scheduler"], v["lr_warmup_steps"], v["lr_warmup_start_factor"]) == ("linear_warmup", 3, 0.1)
    assert (v["critic_lr_warmup_steps"], v["critic_lr_warmup_start_factor"]) == (5, 0.05)
    assert conv.ok, conv.refused


def test_interpolations_and_defaults(tmp_path):
    (tmp_path / "base.yaml").write_text("a: {b: 2, c: 3}\nd: x\n")
    (tmp_path / "top.yaml").write_text(
        "defaults: base.yaml\na: {c: 4, e: '${mul:${.b}, ${.c}}', f: '${a.b}-${d}', g: '${..d}'}\n"
    )
    tree, unresolved = read_seed_config(tmp_path / "top.yaml")
    assert tree == {"a": {"b": 2, "c": 4, "e": 8, "f": "2-x", "g": "x"}, "d": "x"}
    assert unresolved == {}


def test_conflicting_values_of_two_files_are_refused(tmp_path):
    critic = ALIGNER_CRITIC.replace("gradient_clip_val: 1.0", "gradient_clip_val: 0.5")
    paths = write(tmp_path, {"actor.yaml": ALIGNER_ACTOR, "critic.yaml": critic})
    conv = convert("nemo-aligner", paths)
    assert any("critic.yaml: trainer.ppo.gradient_clip_val: not supported: sets max_grad_norm" in r
               for r in conv.refused)
    assert finish(conv)["max_grad_norm"] == 1.0


# --------------------------------------------------------------------------------------------------------
# docs/seeds.md holds the rules' tables
# --------------------------------------------------------------------------------------------------------


def test_docs_tables_equal_the_rules():
    text = DOC.read_text()
    for block in (seed_totals_table(), seed_tables()):
        assert block in text, "docs/seeds.md is out of date: paste rlbits.loops.convert.seed_tables() / " \
                              "seed_totals_table() between the markers"
    for seed in RULES:
        assert f"### {seed}:" in text
