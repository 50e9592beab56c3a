"""Models: loading and saving HF folders (``load``), value and ILQL heads (``heads``), teacher-forced
logprobs and values (``forward``), LoRA (``lora``), frozen bottom layers (``frozen_layers``), packed projections (``packed``), reward models (``reward``),
ILQL-steered decoding (``steered``) and tiny configs for tests (``tiny``).

    from rlbits.models import ILQLModel, load_policy

Names load on first use, so ``import rlbits.models`` does not import transformers or peft until needed."""

from __future__ import annotations

from rlbits._lazy import lazy_exports

_LAZY = {
    # load
    "PICKLE_SUFFIXES": "rlbits.models.load",
    "CheckpointNotFoundError": "rlbits.models.load",
    "check_folder": "rlbits.models.load",
    "check_safetensors": "rlbits.models.load",
    "freeze": "rlbits.models.load",
    "load_policy": "rlbits.models.load",
    "load_pretrained": "rlbits.models.load",
    "load_tokenizer": "rlbits.models.load",
    "prepare_tokenizer": "rlbits.models.load",
    "read_json": "rlbits.models.load",
    "reference_policy": "rlbits.models.load",
    "save_pretrained": "rlbits.models.load",
    # frozen_layers
    "decoder_blocks": "rlbits.models.frozen_layers",
    "freeze_bottom_layers": "rlbits.models.frozen_layers",
    # heads
    "ILQL_HEADS_CONFIG": "rlbits.models.heads",
    "ILQL_HEADS_WEIGHTS": "rlbits.models.heads",
    "VALUE_HEAD_CONFIG": "rlbits.models.heads",
    "VALUE_HEAD_WEIGHTS": "rlbits.models.heads",
    "ILQLModel": "rlbits.models.heads",
    "ValueModel": "rlbits.models.heads",
    "make_head": "rlbits.models.heads",
    # forward
    "HEADS": "rlbits.models.forward",
    "HEAD_MEMORY_BUDGET_MB": "rlbits.models.forward",
    "PLAIN_HEAD_MODEL_TYPES": "rlbits.models.forward",
    "PackedForwards": "rlbits.models.forward",
    "accepts_logits_to_keep": "rlbits.models.forward",
    "choose_head": "rlbits.models.forward",
    "critic_values": "rlbits.models.forward",
    "packed_sequences": "rlbits.models.forward",
    "policy_logprobs": "rlbits.models.forward",
    "position_ids_from_mask": "rlbits.models.forward",
    "response_hidden": "rlbits.models.forward",
    "response_logits": "rlbits.models.forward",
    "sparse_tied_embedding_grad": "rlbits.models.forward",
    "split_head": "rlbits.models.forward",
    # lora
    "DEFAULT_TARGETS": "rlbits.models.lora",
    "adapters_disabled": "rlbits.models.lora",
    "apply_lora": "rlbits.models.lora",
    "is_lora": "rlbits.models.lora",
    "merge_lora": "rlbits.models.lora",
    "share_frozen_parameters": "rlbits.models.lora",
    # packed
    "packed_linears": "rlbits.models.packed",
    "packing_available": "rlbits.models.packed",
    # reward
    "RewardModel": "rlbits.models.reward",
    "encode_texts": "rlbits.models.reward",
    "load_classifier": "rlbits.models.reward",
    "load_reward_model": "rlbits.models.reward",
    # steered
    "SteeredPolicy": "rlbits.models.steered",
    # tiny
    "ARCHS": "rlbits.models.tiny",
    "ATTN_IMPLEMENTATION": "rlbits.models.tiny",
    "BOS_ID": "rlbits.models.tiny",
    "CHARS": "rlbits.models.tiny",
    "PAD_ID": "rlbits.models.tiny",
    "UNK_ID": "rlbits.models.tiny",
    "tiny_causal_lm": "rlbits.models.tiny",
    "tiny_config": "rlbits.models.tiny",
    "tiny_tokenizer": "rlbits.models.tiny",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
