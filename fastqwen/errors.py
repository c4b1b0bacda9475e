"""The one exception type for mistakes a user can make (bad path, bad config, bad argument)."""


class UserError(Exception):
    """A problem with the user's input, reported as one line naming the bad value."""
