"""The standard workload of issue 7, shared by the benchmark scripts (imports torch, transformers and
tokenizers only, so the TRL venvs can import it too).

GPT-2 architecture, 4 layers, width 256, 4 heads, vocabulary 32,000 (11.4M parameters), random init,
fp32; 16-token prompts; 32 new tokens at temperature 1 with EOS disabled; a rule-based reward.

The tokenizer is a word-level one over the ids: token ``i`` is the word ``w{i}`` (0 = ``<pad>``,
1 = ``<unk>``, ``vocab - 1`` = ``</s>``, the EOS token as in ``rlbits.models.tiny``), so a prompt of 16
words is 16 tokens and decoding joins words with spaces. "EOS disabled": prompts never contain EOS and a
random-init model samples it with probability ~1/32000 per token, so in practice every row decodes all 32
tokens (the benchmarks record the mean response length to show it); both frameworks need an EOS id to run
(rlbits refuses a tokenizer without one).
The reward of a response is the fraction of its words with an even id (computable from text or ids alike).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

PAD_ID = 0
UNK_ID = 1


def model_config(
    vocab: int = 32000, width: int = 256, layers: int = 4, heads: int = 4, positions: int = 1024
):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        n_positions=positions,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=PAD_ID,
        eos_token_id=None,
        pad_token_id=PAD_ID,
    )


def tokenizer(vocab: int = 32000):
    """A word-level fast tokenizer whose token ``i`` is ``w{i}``; pad ``<pad>`` (0), EOS ``</s>`` (vocab - 1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": PAD_ID, "<unk>": UNK_ID}
    words.update({f"w{i}": i for i in range(2, vocab - 1)})
    words["</s>"] = vocab - 1
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )
    fast.padding_side = "left"
    return fast


def _save_random_model(path: Path, model_class, config, *, seed: int, stamp: str) -> Path:
    """Save a random-init ``model_class(config)`` (EOS never stops generation) and the word-level tokenizer
    to ``path``; reuse the folder when its ``seed.txt`` holds ``stamp``."""
    import torch

    if (path / "config.json").is_file() and (path / "seed.txt").is_file() and (path / "seed.txt").read_text() == stamp:
        return path
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_ID
    model.save_pretrained(path)
    tokenizer(config.vocab_size).save_pretrained(path)
    (path / "seed.txt").write_text(stamp)
    return path


def build_model_folder(path: str | os.PathLike, *, seed: int = 0, **arch) -> Path:
    """Save a random-init GPT-2 (``model_config(**arch)``) and the tokenizer to ``path`` (HF format); reuse
    the folder if it already holds the same config."""
    from transformers import GPT2LMHeadModel

    stamp = f"{seed} {sorted(arch.items())}"
    return _save_random_model(Path(path), GPT2LMHeadModel, model_config(**arch), seed=seed, stamp=stamp)


def prompts(n: int, *, length: int = 16, vocab: int = 32000, seed: int = 0) -> list[str]:
    """``n`` prompts of ``length`` random words (tokens 2..vocab-1)."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(2, vocab)}" for _ in range(length)) for _ in range(n)]


def reward_from_text(response: str) -> float:
    """Fraction of the response's words with an even id (0 for an empty response)."""
    words = response.split()
    if not words:
        return 0.0
    return sum(1 for w in words if w[1:].isdigit() and int(w[1:]) % 2 == 0) / len(words)


def rlbits_reward(prompts, responses, **columns) -> list[float]:
    """The reward as an ``rlbits.score`` callable."""
    return [reward_from_text(r) for r in responses]


def trl_reward(prompts, completions, **kwargs) -> list[float]:
    """The reward as a TRL reward function."""
    return [reward_from_text(c) for c in completions]


def smollm2_config(positions: int = 8192):
    """SmolLM2-135M's exact architecture (Llama: 30 layers, width 576, 9 heads / 3 KV heads, MLP 1536,
    vocabulary 49,152, tied embeddings; 134.5M parameters) for a random-init stand-in of the real model
    (``rlbits model get smollm2-135m`` gives the real weights)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=positions, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=PAD_ID, eos_token_id=None, pad_token_id=PAD_ID,
    )


def build_smollm2_folder(path: str | os.PathLike, *, seed: int = 0) -> Path:
    """Save a random-init model of SmolLM2-135M's architecture (``smollm2_config``) with the word-level
    tokenizer over its 49,152 ids (EOS = 49,151, never sampled in practice) to ``path``; reuse it if there."""
    from transformers import LlamaForCausalLM

    config = smollm2_config(positions=2048)
    return _save_random_model(Path(path), LlamaForCausalLM, config, seed=seed, stamp=f"smollm2 {seed}")


class ForcedLengths:
    """A logits processor that ends row ``j`` of one ``generate`` call with EOS at exactly ``lengths[j]`` new
    tokens (the uneven workload of ``bench_step.py --lengths uneven``), the same on every framework: an HF
    ``LogitsProcessor`` and an rlbits ``logits_processor`` alike (``f(input_ids [A, P + t - 1], scores [A, V])
    -> scores``, called once per new token with the ids so far). Use a new instance per ``generate`` call.

    Rows are numbered group-major, as both rlbits and TRL lay out a batch: the call's distinct prompts in
    order of first appearance ``g``, ``group_size`` samples each, so row ``g * group_size + k``. A row must be
    recognised later from its own ids alone (rlbits' ``continuous_batching`` hands the processor only the rows
    still decoding; HF keeps all rows), and the samples of one prompt share its ids: so at the first token
    sample ``k`` may draw only ids ``== k (mod group_size)`` (its own distribution restricted to those ids),
    and from then on ``k`` is its first response id modulo ``group_size`` and ``g`` is found by its prompt.

    Each step: a row whose length is reached gets ``-inf`` everywhere but EOS (0); every other row gets
    ``-inf`` at EOS (it never ends early; a finished row still in the batch keeps finite logits, so nothing
    samples from NaN). The sampled tokens are otherwise the model's own. Behaviour logprobs are untouched
    on both sides (rlbits' ``generate`` reports the raw logits', TRL recomputes them with a forward).

    Raises:
        ValueError: the first call's rows are not ``len(lengths)``, or a prompt has other than ``group_size``
            rows.
    """

    def __init__(self, lengths, eos_token_id: int, group_size: int):
        import torch

        self.lengths = torch.as_tensor(list(lengths), dtype=torch.long)
        self.eos = int(eos_token_id)
        self.group_size = int(group_size)
        self.prompt_len = None
        self.keys = None  # [G] int64: each group's prompt hash, in order of first appearance

    def _hash(self, prompts):
        import torch

        weights = torch.arange(1, prompts.shape[1] + 1, device=prompts.device, dtype=torch.long) * 1_000_003
        return (prompts.long() * weights).sum(1) ^ (prompts.long().sum(1) << 20)

    def __call__(self, input_ids, scores):
        import torch

        K, device = self.group_size, scores.device
        if self.lengths.device != device:  # once: a copy from pageable host memory each step would sync
            self.lengths = self.lengths.to(device)
        lengths = self.lengths
        if self.prompt_len is None:  # the first token: every row of the call is here
            self.prompt_len = input_ids.shape[1]
            if input_ids.shape[0] != len(self.lengths):
                raise ValueError(f"ForcedLengths: {len(self.lengths)} lengths for a call of {input_ids.shape[0]} rows")
            keys = self._hash(input_ids).tolist()
            order = list(dict.fromkeys(keys))  # distinct prompts, first appearance first
            group = torch.tensor([order.index(key) for key in keys], device=device)
            if any(keys.count(key) != K for key in order):
                raise ValueError(f"ForcedLengths: every prompt needs {K} rows in the call")
            self.keys = torch.tensor(order, device=device)
            same = group[:, None] == group[None, :]
            sample = (same & torch.ones_like(same).tril(-1)).sum(1)  # earlier rows of the same prompt
            t = 1
            ids = torch.arange(scores.shape[1], device=device)
            own = (ids[None, :] % K) == sample[:, None]  # [A, V]: the ids sample k may start with
            scores = scores.masked_fill(~own, float("-inf"))
        else:
            t = input_ids.shape[1] - self.prompt_len + 1  # the length once this token is appended
            key = self._hash(input_ids[:, : self.prompt_len])
            group = (key[:, None] == self.keys[None, :]).long().argmax(1)
            sample = input_ids[:, self.prompt_len] % K
        length = lengths[group * K + sample]
        scores = scores.clone()
        scores[:, self.eos] = float("-inf")
        forced = torch.full_like(scores[0], float("-inf"))
        forced[self.eos] = 0.0
        return torch.where((length == t)[:, None], forced[None, :], scores)  # no host sync: fine on a GPU
