"""Distributed helpers: the only package in rlbits that imports ``torch.distributed``."""
