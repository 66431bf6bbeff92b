"""Exceptions for bad input, each with a message that names what is wrong (argument, field, file,
tensor; expected against found). `jaxmtp`'s command line reports these in one line; any other
exception is a bug and keeps its traceback."""


class InputError(ValueError):
    """An argument's value is refused; the message names the argument."""


class ConfigError(InputError):
    """A model configuration is invalid or unsupported; the message names the field."""


class CheckpointError(InputError):
    """A checkpoint cannot be read as asked; the message names the file and tensor."""


class ArgumentTypeError(TypeError):
    """An argument has the wrong type; the message names the argument and the type expected."""
