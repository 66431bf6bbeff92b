"""jaxmtp: DeepSeek-V3 in JAX/Flax with speculative decoding by its own Multi-Token-Prediction layer."""

import os

from jaxmtp.checkpoint import load, save
from jaxmtp.config import ModelConfig
from jaxmtp.errors import CheckpointError, ConfigError
from jaxmtp.generation import GenerationOutput, generate
from jaxmtp.model import Model, init

# The bundled demo checkpoint (HF layout + tokenizer.json): a small DeepSeek-V3 with its MTP layer,
# trained on the Python standard library's source; see demo_model/README.md.
DEMO_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_model")

__all__ = ["DEMO_MODEL", "CheckpointError", "ConfigError", "GenerationOutput", "Model", "ModelConfig", "generate", "init", "load",
           "save"]
