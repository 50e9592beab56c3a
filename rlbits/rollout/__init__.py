"""Sampling responses from a policy (``generate``) and scoring them (``score``)."""
