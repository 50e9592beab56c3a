"""Resident-memory readings shared by the benchmark scripts (Linux: ``/proc/self/status``)."""

from __future__ import annotations

import threading
import time


def rss_mib() -> float:
    """This process's resident set (VmRSS) in MiB; NaN where ``/proc`` has none."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class PeakSampler:
    """Highest VmRSS while the block runs (a thread samples it every 2 ms)."""

    def __init__(self) -> None:
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mib())
            time.sleep(0.002)

    def __enter__(self) -> PeakSampler:
        self.peak = rss_mib()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mib())
