"""jaxmtp: DeepSeek-V3 in JAX/Flax with speculative decoding by its own Multi-Token-Prediction layer."""

import os

from jaxmtp.checkpoint import load, save
from jaxmtp.config import CONFIGS, ModelConfig
from jaxmtp.errors import ArgumentTypeError, CheckpointError, ConfigError, InputError
from jaxmtp.generation import GenerationOutput, TokenStream, generate, generate_stream
from jaxmtp.generation_config import GenerationConfig
from jaxmtp.model import Model, init
from jaxmtp.sharding import make_mesh
from jaxmtp.stats import GenerationStats

# The bundled demo checkpoint (HF layout + tokenizer.json): a small DeepSeek-V3 with its MTP layer,
# trained on the Python standard library's source; see demo_model/README.md.
DEMO_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_model")

__all__ = ["ArgumentTypeError", "CONFIGS", "DEMO_MODEL", "CheckpointError", "ConfigError", "GenerationConfig",
           "GenerationOutput", "GenerationStats", "InputError", "Model", "ModelConfig", "TokenStream", "generate",
           "generate_stream", "init", "load", "make_mesh", "save"]
