"""The base of every error whose message tells the whole story: the CLI prints it as one line and exits 1."""


class MeshtrainError(Exception):
    """Bad input or a failed job, explained: what went wrong, where, and what to do about it."""

    # True where every rank of a job raises the same error from the same input (a bad key, an unknown model): the
    # CLI prints it on rank 0 only, not once per rank.
    same_on_every_rank = False


class DataError(MeshtrainError, RuntimeError):
    """A dataset or tokenizer that is missing, corrupt or unusable; the message says what to run or change.
    (Here rather than in data/text.py: the tokenizers, the ERA5 readers and text.py all raise it.)"""
