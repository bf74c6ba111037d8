"""The one error type haloshard raises for user mistakes."""


class HaloError(ValueError):
    """A halo layout, spec or exchange was given a value it cannot use.

    The message names the value received and what was expected. Raised on every rank
    of the group when the mistake was seen on any one of them.
    """


def named(error: HaloError, module: str) -> HaloError:
    """A copy of `error` with the module it was raised for in front of its message, to
    raise `from error`. An error already named by an inner module (or whose message names
    the module already) keeps its message.

    Example::
        >>> str(named(HaloError("got 3 slices, expected 4"), "encoder.conv_in (Conv3d)"))
        'encoder.conv_in (Conv3d): got 3 slices, expected 4'
    """
    inner, text = getattr(error, "module", None), str(error)
    said = inner is not None or module in text  # e.g. a timeout naming its layer
    # `text`, not `error`, in the f-string: dynamo formats a traced exception only lazily,
    # and a lazy message cannot be raised at trace time (`_tracing.surfaces_errors`)
    renamed = HaloError(text if said else f"{module}: {text}")
    renamed.module = inner if inner is not None else module  # type: ignore[attr-defined]
    return renamed


def raise_rejected(own: str | None, flags: list[object], what: str) -> None:
    """The first step of every agreement: this rank's own problem raises here; a problem
    another rank flagged in its row raises the same kind of error on every other rank.

    Example::
        >>> raise_rejected(None, [0, 0, 0], "halo_exchange")  # nobody flagged: returns
        >>> # [0, 1, 0] raises "rank(s) [1] of the group rejected their halo_exchange ..."
    """
    if own is not None:
        raise HaloError(own)
    bad = [rank for rank, flag in enumerate(flags) if flag]
    if bad:
        raise HaloError(f"rank(s) {bad} of the group rejected their {what} arguments (see the "
                        "error on those ranks); every rank must pass valid arguments")
