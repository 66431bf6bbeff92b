"""The serving engine: continuous batching with MTP speculation (`Engine`), several engines over
one model as one (`Replicas`), and the request and event types they speak (`Request`, `Event`,
`Handle`)."""

from jaxmtp.engine.engine import Engine, EngineConfig
from jaxmtp.engine.replicas import Replicas
from jaxmtp.engine.requests import Event, Handle, NotAdmitting, QueueFull, Request

__all__ = ["Engine", "EngineConfig", "Event", "Handle", "NotAdmitting", "QueueFull", "Replicas", "Request"]
