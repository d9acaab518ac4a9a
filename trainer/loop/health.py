"""Training health: gradient-norm spikes and the NaN/Inf guard."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class SpikeEvent:
    start_step: int
    steps: int
    peak: float
    mean_before: float


@dataclass
class GradNormMonitor:
    """A step is a spike when its gradient norm exceeds ``factor`` x the running mean of the
    last ``window`` non-spike steps. Consecutive spike steps form one event; ``events`` records
    when each began, how many steps it lasted and its peak."""

    window: int = 20
    factor: float = 3.0
    history: deque = field(default_factory=deque)
    events: list[SpikeEvent] = field(default_factory=list)
    in_spike: bool = False

    def mean(self) -> float | None:
        return sum(self.history) / len(self.history) if len(self.history) >= min(self.window, 5) else None

    def update(self, step: int, norm: float) -> bool:
        """Record ``norm`` for ``step``; returns True when this step is a spike."""
        if not math.isfinite(norm):
            return False  # the NaN guard handles these
        mean = self.mean()
        spike = mean is not None and norm > self.factor * mean
        if spike:
            if self.in_spike:
                ev = self.events[-1]
                ev.steps += 1
                ev.peak = max(ev.peak, norm)
            else:
                self.events.append(SpikeEvent(step, 1, norm, mean))
            self.in_spike = True
            return True
        self.in_spike = False
        self.history.append(norm)
        while len(self.history) > self.window:
            self.history.popleft()
        return False

    def state(self) -> dict:
        return {"history": list(self.history), "in_spike": self.in_spike,
                "events": [vars(e).copy() for e in self.events]}

    def load_state(self, state: dict) -> None:
        self.history = deque(state["history"])
        self.in_spike = state["in_spike"]
        self.events = [SpikeEvent(**e) for e in state["events"]]


def finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)
