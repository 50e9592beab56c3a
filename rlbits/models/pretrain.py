"""Base-model builder, re-exported from ``rlbits.tasks.pretrain``.

The implementation lives in the ``tasks`` layer because ``task.base_model()`` builds the model on first use
and DESIGN.md's layers let ``tasks`` import nothing above it (``models`` is above). It depends only on
``transformers``/``tokenizers`` and the task modules, not on ``rlbits.models``.
"""

from rlbits.tasks.pretrain import (  # noqa: F401
    __all__,
    cache_dir,
    default_model_dir,
    ensure_base_model,
    evaluate,
    plateau_check,
    pretrain,
    train_tokenizer,
)
