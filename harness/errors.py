"""The one exception type the CLI turns into a one-line error and a non-zero exit (never a traceback)."""


class DtbenchError(Exception):
    """A user-facing error: bad suite, missing data, unknown model or decoder, unusable database.

    The message is one line that says what is wrong and, where possible, how to fix it.
    """
