"""What happens when an actor crashes."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ("RestartPolicy",)


@dataclass(frozen=True)
class RestartPolicy:
    """Restart a crashed actor at most ``max_restarts`` times within ``within_s`` seconds.

    A restart builds a fresh actor from the same factory and arguments; it keeps the mailbox
    (and so the messages still queued) and every ActorRef stays valid. Past the limit the
    actor dies and every pending or later request fails with ActorDeadError.
    """

    max_restarts: int = 0
    within_s: float = 60.0

    @classmethod
    def never(cls) -> RestartPolicy:
        return cls(0)

    @classmethod
    def on_failure(cls, max_restarts: int = 3, within_s: float = 60.0) -> RestartPolicy:
        if max_restarts < 1:
            raise ValueError("max_restarts must be >= 1 (use RestartPolicy.never())")
        return cls(max_restarts, within_s)


@dataclass
class RestartBudget:
    """The restarts a policy still allows, by time."""

    policy: RestartPolicy
    _times: deque[float] = field(default_factory=deque)

    def allow(self, now: float) -> bool:
        while self._times and now - self._times[0] > self.policy.within_s:
            self._times.popleft()
        if len(self._times) >= self.policy.max_restarts:
            return False
        self._times.append(now)
        return True
