"""The data layer's error: a malformed file or record."""


class DataError(ValueError):
    """A data file or record is malformed; the message names the file and the 1-based line/row."""
