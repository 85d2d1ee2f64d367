"""Progress of every long step (recording, preparing, benchmarks), logged on the ``nimble`` logger.

The library never prints.  It logs progress at INFO on ``logging.getLogger("nimble")`` and adds
only a :class:`logging.NullHandler`, the usual convention for a library: the application decides
what is shown.  A program that calls Nimble sees no progress until it configures logging, e.g.
``logging.basicConfig(level=logging.INFO)``, or a handler on the ``nimble`` logger.  The
``nimble`` command line installs a handler that writes ``[tag] message`` lines to stderr, and its
``-q`` silences them.

A call made with ``quiet=True`` logs at DEBUG instead, so it stays silent where INFO is shown.
"""
from __future__ import annotations

import logging

LOGGER_NAME = "nimble"
logger = logging.getLogger(LOGGER_NAME)
logger.addHandler(logging.NullHandler())


def say(message: str, quiet: bool = False, tag: str | None = "nimble") -> None:
    """Log ``message`` on the ``nimble`` logger (INFO; DEBUG when ``quiet``).

    ``tag`` names the step's source for a handler that shows it (the record's ``tag``
    attribute; the command line prints ``[tag] message``, or the bare message for None).
    """
    logger.log(logging.DEBUG if quiet else logging.INFO, message, extra={"tag": tag})
