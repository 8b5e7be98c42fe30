"""The one exception type for a user's mistake: printed as a paragraph, never as a traceback."""


class UserError(Exception):
    """A problem with the user's config or input files, with what to do about it in the message."""
