"""The one exception type users catch; each subclass names what went wrong and how to fix it."""


class LocalspecError(Exception):
    """Base class of every error localspec raises on purpose (the CLI prints it and exits 2)."""
