"""Argument errors in one voice.

A message says what was wrong, what is allowed and what to do, and ends with
``Received: name=value (of type T)``. ``TypeError`` for a wrong type, ``ValueError`` for
a wrong value; the functions return the exception so that ``raise`` stays visible at the
call site (and type checkers see the branch end).
"""

from __future__ import annotations

__all__ = ["received", "type_error", "value_error"]


def received(name: str, value: object) -> str:
    """The closing sentence of every argument error."""
    return f"Received: {name}={value!r} (of type {type(value).__name__})"


def _message(message: str, name: str, value: object) -> str:
    message = message.rstrip()
    if not message.endswith((".", "!", "?", ":")):
        message += "."
    return f"{message} {received(name, value)}"


def type_error(message: str, name: str, value: object) -> TypeError:
    """A ``TypeError`` whose text is ``message`` followed by :func:`received`."""
    return TypeError(_message(message, name, value))


def value_error(message: str, name: str, value: object) -> ValueError:
    """A ``ValueError`` whose text is ``message`` followed by :func:`received`."""
    return ValueError(_message(message, name, value))
