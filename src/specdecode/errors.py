"""Errors a user can act on. Each message says what was wrong and what to do."""


class SpecDecodeError(Exception):
    """Base class of every error specdecode raises on purpose."""


class ModelLoadError(SpecDecodeError):
    """A model could not be found, read or understood."""


class ChecksumError(ModelLoadError):
    """A downloaded or assembled file does not have the expected sha256."""


class InvalidRequestError(SpecDecodeError, ValueError):
    """A generation request has bad parameters (empty prompt, gamma <= 0, top_p outside (0, 1], ...)."""
