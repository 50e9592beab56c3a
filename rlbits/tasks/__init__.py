"""Built-in tasks: prompts, rewards and base-model corpora."""
