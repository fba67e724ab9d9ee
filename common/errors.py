"""Exception types shared by every service. Transport layers map them to status codes in one place each."""


class InklingError(Exception):
    """Base class of the project's own errors."""


class ConfigError(InklingError):
    """A config file or setting is invalid; the message names the field and the value."""


class CheckpointError(InklingError):
    """A checkpoint is missing tensors, has unexpected ones, or has wrong shapes/dtypes."""


class InvalidInputError(InklingError):
    """A request (prompt, media item, sampling parameter) is invalid; the message names the field or item."""


class ResourceExhaustedError(InklingError):
    """A request cannot be admitted now (queue full, too many tokens for the memory budget)."""


class UnavailableError(InklingError):
    """A dependency (encoder, decode replica) is unreachable; retrying elsewhere may succeed."""
