"""The error that recxla.data's file and wire formats raise for input they cannot trust."""


class DataFormatError(ValueError):
    """A data file or compact batch that is not what it claims to be.

    Raised for a truncated or corrupt Parquet file or compact batch, a file without recxla's
    layout metadata, files of one dataset whose layouts differ, or a dataset that does not fit
    the embedding tables it is checked against. The message names the file (or "compact batch")
    and what is wrong. A subclass of ValueError, so `except ValueError` catches it too.
    """
