"""The one error type users see: a message that says what went wrong and how to fix it."""


class RagSpecError(Exception):
    """A problem the user can fix; ``str(err)`` is one paragraph that names the fix.

    The CLI prints it without a traceback and exits non-zero.
    """
