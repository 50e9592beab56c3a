"""SFT control for the arithmetic RL targets: does more imitation of the corpus also raise test accuracy?

The arithmetic base model imitates a demonstrator that drops carries 70% of the time (``rlbits.tasks.arithmetic``).
An RL loop with the exact-match reward should lift greedy test accuracy well above the base model's; this
script continues the base model's own supervised training -- the same corpus (``task.corpus(corpus_size,
seed=0)``, the documents it was trained on), the same recipe as ``rlbits.models.pretrain`` (AdamW with betas
(0.9, 0.95), weight decay 0.01 on matrices, batch 128, gradient clip 1.0, next-token loss on each document
plus ``<eos>``) -- for a fixed wall-clock budget, and measures greedy test accuracy before and after with
``rlbits.models.pretrain.evaluate`` (HF ``generate``, all 500 test prompts). A gain under 5 points (while
RL gains >= 20) is the evidence that RL learned something imitation cannot.

The learning rate is constant at the value the pretraining schedule ended at (10% of the peak, i.e.
``PRETRAIN["lr"] / 10``); ``--lr`` overrides it (e.g. the peak 3e-3).

    .venv/bin/python benchmarks/sft_control.py --seconds 300
    .venv/bin/python benchmarks/sft_control.py --rl-run runs/rloo_arithmetic --rl-run runs/grpo_arithmetic

With ``--rl-run`` (repeatable) the budget defaults to the longest run's wall time (last ``time_s`` in its
metrics.jsonl) and each run's ``final/`` policy is evaluated the same way. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlbits.loops.run import read_metrics
from rlbits.models.pretrain import _encode, evaluate
from rlbits.tasks import get_task

TASK = "arithmetic"


def continue_pretraining(model_path: str, out_dir: str, *, seconds: float, lr: float | None, seed: int) -> dict:
    """Train ``model_path`` on its task corpus with the pretraining recipe for ``seconds`` of wall clock;
    save the result to ``out_dir``. Returns ``{"steps", "seconds", "lr", "final_loss"}``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    module = get_task(TASK)
    settings = module.PRETRAIN
    lr = settings["lr"] / 10 if lr is None else lr
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    texts = module.corpus(settings["corpus_size"], 0)
    data, lengths = _encode(tokenizer, texts, settings["n_positions"])
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95)
    )
    order = torch.Generator().manual_seed(seed)
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    steps = 0
    while time.perf_counter() - start < seconds:
        idx = torch.randint(len(data), (settings["batch_size"],), generator=order)
        width = int(lengths[idx].max())
        input_ids = data[idx, :width]
        attention_mask = torch.arange(width) < lengths[idx, None]
        labels = input_ids.masked_fill(~attention_mask, -100)
        loss = model(input_ids=input_ids, attention_mask=attention_mask.long(), labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        steps += 1
    elapsed = time.perf_counter() - start
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    tail = losses[-50:] or [float("nan")]
    return {"steps": steps, "seconds": round(elapsed, 1), "lr": lr, "final_loss": round(sum(tail) / len(tail), 4)}


def run_seconds(run_dir: str) -> float:
    """Wall time of a finished run: the last ``time_s`` of its metrics.jsonl."""
    return float(read_metrics(run_dir)[-1]["time_s"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="base model folder (default: the arithmetic task's)")
    parser.add_argument("--seconds", type=float, default=None, help="SFT wall-clock budget (default 300, or the RL runs' wall time)")
    parser.add_argument("--rl-run", action="append", default=[], help="an RL run dir whose final/ to evaluate too")
    parser.add_argument("--lr", type=float, default=None, help="constant learning rate (default: pretraining's final lr)")
    parser.add_argument("--seed", type=int, default=1, help="batch order of the continued training")
    parser.add_argument("--out", default=None, help="where to save the SFT model (default: a temporary folder)")
    args = parser.parse_args(argv)

    model = args.model or get_task(TASK).base_model()
    seconds = args.seconds
    if seconds is None:
        seconds = max((run_seconds(r) for r in args.rl_run), default=300.0)
    out = args.out or tempfile.mkdtemp(prefix="sft_control_")
    torch.set_num_threads(torch.get_num_threads())

    base = evaluate(model, TASK, greedy=True)
    sft = continue_pretraining(model, out, seconds=seconds, lr=args.lr, seed=args.seed)
    after = evaluate(out, TASK, greedy=True)
    result = {
        "base_accuracy": base["accuracy"],
        "sft_accuracy": after["accuracy"],
        "sft_gain_points": round(100 * (after["accuracy"] - base["accuracy"]), 1),
        "sft": sft,
        "sft_model": out,
    }
    for run in args.rl_run:
        acc = evaluate(str(Path(run) / "final"), TASK, greedy=True)["accuracy"]
        result[f"rl:{run}"] = {
            "accuracy": acc,
            "gain_points": round(100 * (acc - base["accuracy"]), 1),
            "seconds": run_seconds(run),
        }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
