"""DeepSeek-V4 (V4-Flash, V4-Pro): config, modules with caches stored by position, and the model."""

from jaxmtp.models.deepseek_v4.config import CSA, HCA, SLIDING, V4Config
from jaxmtp.models.deepseek_v4.checkpoint import load_v4, save_v4
from jaxmtp.models.deepseek_v4.model import V4Model, init_v4

__all__ = ["CSA", "HCA", "SLIDING", "V4Config", "V4Model", "init_v4", "load_v4", "save_v4"]
