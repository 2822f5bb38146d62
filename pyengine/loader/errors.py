"""The one error type model loading raises, so the CLI prints one line instead of a traceback."""


class ModelLoadError(Exception):
    """A model could not be found or read; the message names the file (or repo) and what is wrong."""
