"""Sampling responses from a policy (``generate``), multi-turn episodes with envs (``generate_episodes``) and
scoring them (``score``)."""
