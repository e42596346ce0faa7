"""One exception type for mistakes a user can fix: the CLI prints it without a stack trace."""


class TomlensError(Exception):
    """A user-facing error: what went wrong and what to do about it.

    Raise it for bad input (unknown model, malformed stimulus row, unknown site, misaligned pair);
    let programming errors surface as ordinary exceptions.
    """

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(problem if fix is None else f"{problem}\n  fix: {fix}")
