"""The cache's two errors: a model it cannot serve, and a use it cannot take."""


class UnsupportedModelError(ValueError):
    """The model (or one of its settings) cannot be used with kvcompress."""


class CacheMisuseError(ValueError):
    """A cache was used for something it cannot hold (a second prompt, another model, ...)."""
