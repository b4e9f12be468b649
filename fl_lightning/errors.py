"""User-facing errors: bad configs or data. ``train.py`` prints them as one line and exits with code 2."""


class ConfigError(ValueError):
    """A configuration or data problem the user can fix (the message says how)."""
