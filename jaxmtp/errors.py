"""Exceptions raised for bad input. Both are `ValueError`s so callers can catch either broadly."""


class ConfigError(ValueError):
    """A model configuration is invalid or unsupported; the message names the field."""


class CheckpointError(ValueError):
    """A checkpoint cannot be read as asked; the message names the file and tensor."""
