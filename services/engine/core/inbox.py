"""What request threads tell the engine loop: the messages of its inbox."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from services.engine.core.sequence import FinishReason, SeqEvent, Sequence


@dataclass(frozen=True)
class AddSequence:
    seq: Sequence
    on_event: Callable[[SeqEvent], None]   # the reader: called on the loop thread, must not block
    delivered_chars: int = 0               # resumed after a failover: text another engine already delivered


@dataclass(frozen=True)
class AbortSequence:
    seq_id: int
    reason: FinishReason                   # CANCELLED (the client left or the call ended) or DEADLINE


InboxMessage = AddSequence | AbortSequence
