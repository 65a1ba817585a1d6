"""The cache's two errors: a model it cannot serve, and a use it cannot take."""


class UnsupportedModelError(ValueError):
    """The model (or one of its settings) cannot be used with kvcompress."""


class CacheMisuseError(ValueError):
    """A cache was used for something it cannot hold (a second prompt, another model, ...). ``cli``: the same refusal
    in the command line's words, where the library's names a Python remedy."""

    def __init__(self, message: str, cli: str | None = None) -> None:
        super().__init__(message)
        self.cli = cli
