"""Training loops: PPO, REINFORCE/RLOO/GRPO and ILQL."""
