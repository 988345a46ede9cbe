"""Memory below the transports: copy engines (CUDA, and a host stand-in), pinned staging pools,
and the staging pipelines that move device memory through host chunks."""

from ._engine import CopyEngine, DeviceBuffer, Event, HostChunk, HostEngine, Lane, wait_event
from ._pinned import CHUNK_BYTES, DEPTH, PinnedPool
from ._pipeline import Move, Piece, StageIn, download, hand_back, scatter, stage_out

__all__ = [
    "CHUNK_BYTES",
    "DEPTH",
    "CopyEngine",
    "DeviceBuffer",
    "Event",
    "HostChunk",
    "HostEngine",
    "Lane",
    "Move",
    "PinnedPool",
    "Piece",
    "StageIn",
    "download",
    "hand_back",
    "scatter",
    "stage_out",
    "wait_event",
]
