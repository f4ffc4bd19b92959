"""The one error type users see: a message that says what went wrong and how to fix it."""


class RagSpecError(Exception):
    """A problem the user can fix; ``str(err)`` is one paragraph that names the fix.

    The CLI prints it without a traceback and exits non-zero.
    """


class IncompleteOutputWarning(UserWarning):
    """A constrained answer (json_schema, regex, grammar, choices, a tool call) ended before
    its grammar was complete, at the token limit or a stop string: it is not valid under the
    grammar. ``GenerationResult.incomplete`` says the same per answer; raise
    ``max_new_tokens``, or turn this into an error with
    ``warnings.simplefilter("error", IncompleteOutputWarning)``."""
