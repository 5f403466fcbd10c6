"""The one exception type for user mistakes: entrypoints print it as a one-line error and exit 2."""


class UserError(Exception):
    """A mistake the user can fix (bad config, missing file, ...). The message says what and how."""
