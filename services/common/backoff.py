"""Exponential backoff with jitter for loops that retry a remote call until told to stop.

Jitter spreads the retries of many processes (every router watching the same Consul, every
engine re-registering after an outage) instead of having them knock in step.
"""
from __future__ import annotations

import random
import threading


class Backoff:
    def __init__(self, initial: float = 0.1, maximum: float = 10.0):
        self.initial = initial
        self.maximum = maximum
        self.delay = initial

    def reset(self) -> None:
        self.delay = self.initial

    def next_delay(self) -> float:
        """The current delay (+ up to 50% jitter); the one after it is twice as long, up to the maximum."""
        delay = self.delay * random.uniform(1.0, 1.5)
        self.delay = min(self.delay * 2, self.maximum)
        return delay

    def wait(self, stop: threading.Event) -> bool:
        """Sleep the next delay unless ``stop`` is set; True when stopped."""
        return stop.wait(self.next_delay())
