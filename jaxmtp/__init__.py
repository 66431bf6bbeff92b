"""jaxmtp: DeepSeek-V3 in JAX/Flax with speculative decoding by its own Multi-Token-Prediction layer."""

from jaxmtp.checkpoint import load, save
from jaxmtp.config import ModelConfig
from jaxmtp.errors import CheckpointError, ConfigError
from jaxmtp.generation import GenerationOutput, generate
from jaxmtp.model import Model, init

__all__ = ["CheckpointError", "ConfigError", "GenerationOutput", "Model", "ModelConfig", "generate", "init", "load",
           "save"]
