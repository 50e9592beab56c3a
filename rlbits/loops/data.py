"""``PromptStream`` lives in ``rlbits.data.stream`` (one layer below the loops: ILQL's offline dataset draws
its rows in the same order); importable from here too."""

from rlbits.data.stream import PromptStream

__all__ = ["PromptStream"]
