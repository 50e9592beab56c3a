"""Training data that does not come from a rollout: the seeded prompt stream (``stream``) and the offline
dataset of ILQL (``offline``: build, store memory-mapped in the run directory, draw batches through a
torchrl ``ReplayBuffer``)."""
