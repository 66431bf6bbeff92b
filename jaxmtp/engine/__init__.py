"""The serving engine: continuous batching with MTP speculation (`Engine`), and the request and
event types it speaks (`Request`, `Event`, `Handle`)."""

from jaxmtp.engine.engine import Engine, EngineConfig
from jaxmtp.engine.requests import Event, Handle, NotAdmitting, QueueFull, Request

__all__ = ["Engine", "EngineConfig", "Event", "Handle", "NotAdmitting", "QueueFull", "Request"]
