"""Where the command line's output goes.

Results (reports, tables) go to stdout; progress goes to stderr through the ``nimble`` logger
(:mod:`nimble.progress`), which :func:`logging_to_stderr` routes there for one command (``-q``:
warnings only).  Every option that names an output file takes ``-`` for stdout; that output then
takes stdout's place and the text report moves to stderr (:class:`Outputs`), and only one option
of a command may take it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, TextIO

from ..progress import logger, say
from .common import Fail

STDOUT = "-"


class _Tagged(logging.Formatter):
    """``[tag] message``, or the bare message for a record without a tag."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        tag = getattr(record, "tag", None)
        return f"[{tag}] {message}" if tag else message


class _CurrentStderr(logging.StreamHandler):
    """A handler on whatever ``sys.stderr`` is at the time of each record (tests swap it)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(_Tagged())

    @property
    def stream(self) -> TextIO:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ sets it; stderr is always read
        pass


@contextlib.contextmanager
def logging_to_stderr(quiet: bool) -> Iterator[None]:
    """The ``nimble`` logger's INFO lines (WARNING and above with ``quiet``) on stderr while
    a command runs; the logger is left as it was afterwards."""
    handler = _CurrentStderr()
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)
    logger.propagate = False  # the application's root handlers would repeat every line
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


@dataclass
class Outputs:
    """The output-file options of one command, by option name (``--export``) -> path or None.

    ``-`` is stdout; at most one option may take it, and the text report then goes to stderr.
    """
    paths: dict[str, str | None]

    def __post_init__(self) -> None:
        """Check every output before any work, so that a long run is not lost at its end."""
        on_stdout = [name for name, path in self.paths.items() if path == STDOUT]
        if len(on_stdout) > 1:
            raise Fail(f"{' and '.join(on_stdout)} both write to stdout ('-'); give one of "
                       "them a file name")
        for name, path in self.paths.items():
            if path in (None, STDOUT):
                continue
            if Path(path).is_dir():
                raise Fail(f"{name} {path}: a directory; give a file name")
            if not Path(path).parent.is_dir():
                raise Fail(f"{name} {path}: there is no directory {Path(path).parent}")

    @property
    def stdout_taken(self) -> bool:
        return STDOUT in self.paths.values()

    @property
    def report(self) -> TextIO:
        """Where the text report goes: stdout, unless an output took it."""
        return sys.stderr if self.stdout_taken else sys.stdout

    def write(self, option: str, text: str, what: str) -> None:
        """Write ``text`` (``what``, for messages) where ``option`` says."""
        path = self.paths[option]
        if path == STDOUT:
            sys.stdout.write(text)
            sys.stdout.flush()
            return
        try:
            Path(path).write_text(text, encoding="utf-8")
        except OSError as e:
            raise Fail(f"cannot write {what} to {path}: {e.strerror or e}") from None
        say(f"wrote {what} to {path}", tag=None)

    def write_json(self, option: str, data: dict, what: str) -> None:
        """``data`` as indented JSON where ``option`` says (objects JSON cannot hold, such as a
        live recording's meta, are written as text)."""
        self.write(option, json.dumps(data, indent=2, default=str) + "\n", what)

    def write_taskgraph(self, option: str, graph) -> None:
        """A TaskGraph where ``option`` says: plain JSON on stdout, else :meth:`TaskGraph.save`
        (gzip-compressed for a ``.gz`` name)."""
        path = self.paths[option]
        what = f"TaskGraph ({len(graph.tasks)} tasks, {len(graph.buffers)} buffers)"
        if path == STDOUT:
            self.write(option, json.dumps(graph.to_json(), separators=(",", ":")) + "\n", what)
            return
        try:
            graph.save(path)
        except OSError as e:
            raise Fail(f"cannot write {what} to {path}: {e.strerror or e}") from None
        say(f"wrote {what} to {path}", tag=None)


def outputs(args: argparse.Namespace, *options: str) -> Outputs:
    """The :class:`Outputs` of ``args`` for ``options`` (attribute names, e.g. ``"export"``)."""
    return Outputs({"--" + name.replace("_", "-"): getattr(args, name) for name in options})
