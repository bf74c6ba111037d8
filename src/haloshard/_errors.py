"""The one error type haloshard raises for user mistakes."""


class HaloError(ValueError):
    """A halo layout, spec or exchange was given a value it cannot use.

    The message names the value received and what was expected. Raised on every rank
    of the group when the mistake was seen on any one of them.
    """
