"""The one exception type users see for bad input."""


class JaxportError(Exception):
    """Bad input (path, file, key, shape, config value): the message says what to fix."""
