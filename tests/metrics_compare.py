"""Comparing the metrics of two runs (exact-resume tests): everything logged but the timings."""

from __future__ import annotations


def untimed(row: dict) -> dict:
    """A metrics row without its wall-clock fields (``time*``, ``tokens_per_s``), which differ between runs."""
    return {k: v for k, v in row.items() if not k.startswith("time") and k != "tokens_per_s"}


def untimed_by_step(rows: list[dict], first_step: int = 0) -> dict[int, dict]:
    """``{step: untimed(row)}`` for the rows from ``first_step`` on."""
    return {r["step"]: untimed(r) for r in rows if r["step"] >= first_step}
