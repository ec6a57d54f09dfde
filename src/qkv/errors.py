"""One error type for everything the user can get wrong."""


class QkvError(ValueError):
    """An error caused by the user's input; the CLI prints its message on one line and exits with code 2."""
