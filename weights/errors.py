"""The one error a bad checkpoint raises."""


class CheckpointError(ValueError):
    """A checkpoint file, shard index or config is malformed, inconsistent or incomplete.

    The message names the file and, where there is one, the tensor.
    """
