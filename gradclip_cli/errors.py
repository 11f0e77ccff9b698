"""The errors gradclip reports to a user, each tied to the contract's exit code.

Every layer raises one of these with a one-line message; the CLI prints it
and exits with ``exit_code``. Anything else escaping is a bug (shown with
``--debug``). The message is built raw: names, keys and paths as the file and
the command line give them (``quoted()`` where one is quoted), never passed
through ``visible()``; the CLI escapes the whole line once, where it is shown.
"""

from __future__ import annotations

from collections.abc import Iterable


class GradclipError(Exception):
    """Base class: a message for the user and the exit code it maps to.

    ``str(error)`` (and ``error.message``) is the one line the command prints
    after ``gradclip: ``; ``error.exit_code`` the code it exits with (2 for
    ``UsageError``, 3 for ``InputError`` and ``OutputError``). The Python API
    (``gradclip_cli.inspect``, ``gradclip_cli.trend``) raises these.
    """

    exit_code = 3
    # What the run had learned for its report before it failed, already ``visible``:
    # what ``--verify`` could not check. The failure document carries them (a user who
    # asked for a check that was not made is told so, refused or not).
    notes: tuple[str, ...] = ()

    @property
    def message(self) -> str:
        return str(self)

    def noting(self, notes: Iterable[str]) -> GradclipError:
        """This error, carrying ``notes`` too (each once, in order)."""
        self.notes = tuple(dict.fromkeys((*self.notes, *notes)))
        return self


class UsageError(GradclipError):
    """A bad flag or value (exit 2)."""

    exit_code = 2


def stderr_lines(message: str, notes: Iterable[str] = ()) -> list[str]:
    """What stderr shows of a refused run: the one error line (``message``, made visible
    once, by the caller), then one ``note:`` line per note (each ``visible`` where made).

    The error stays one line and the first, whatever the notes say: a script that reads
    stderr's first line reads the error. Notes come here only where the format's output
    carries none (the table; JSON for clip's exit-1 refusal): what ``--verify`` could not
    check is said once, wherever the format shows it.
    """
    return [f"gradclip: {message}", *(f"gradclip: note: {note}" for note in notes)]


# How a message about ``--output-file`` itself begins: such an error is reported on
# stdout, never written to that file (it may be an input).
REPORT_FILE_FLAG = "--output-file"


class InputError(GradclipError):
    """The input cannot be read, holds no gradients, or is refused as unsafe (exit 3)."""

    exit_code = 3


class MissingExtraError(InputError):
    """Reading the input needs an optional extra that is not installed (exit 3)."""


class UnsafeCheckpointError(InputError):
    """The file needs full unpickling, which runs code from the file (exit 3)."""


class IntegrityError(InputError):
    """A stored checksum does not match the data (``--verify``; exit 3)."""


class OutputError(GradclipError):
    """The clipped copy could not be written; the input and target are untouched (exit 3)."""

    exit_code = 3
