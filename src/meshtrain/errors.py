"""The base of every error whose message tells the whole story: the CLI prints it as one line and exits 1."""


class MeshtrainError(Exception):
    """Bad input or a failed job, explained: what went wrong, where, and what to do about it."""
