"""Secrets kept out of every file a run writes.

The config's secret fields (``miles.config.SECRET_FIELDS``: the reward server's token) are saved as
"set" only (``to_dict``: ``config.yaml``, ``trainer.json``, wandb's config). The command line is
recorded twice more — in the run directory's ``.launch.lock`` (for the refusal of a second launch)
and by wandb (its run metadata keeps ``sys.argv``) — so both get :func:`redact_argv`'s copy: the value
of a secret flag, and every occurrence of a secret's value (from the config or from the environment
variables that carry one, ``SECRET_ENV``), become ``<redacted>``. The resume command a run prints on
the console (:func:`miles.train.outcome.resume_command`) leaves a secret flag out altogether
(:func:`without_secret_flags`) and says where the token comes from instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from miles.config import SECRET_FIELDS, Config
from miles.rewards.remote import TOKEN_ENV

SECRET_ENV = (TOKEN_ENV,)  # environment variables whose value is a secret
HIDDEN = "<redacted>"
_FLAGS = {f"--{path}" for path in SECRET_FIELDS} | {f"--{path.replace('_', '-')}" for path in SECRET_FIELDS}


def secret_values(cfg: Config | None = None) -> list[str]:
    """The secrets this process knows: the config's secret fields and the secret environment variables."""
    values = [os.environ.get(name) for name in SECRET_ENV]
    for path in SECRET_FIELDS if cfg is not None else ():
        node = cfg
        for part in path.split("."):
            node = getattr(node, part, None)
        values.append(node if isinstance(node, str) else None)
    return sorted({v for v in values if v}, key=len, reverse=True)


def redact_argv(argv: Sequence[str], secrets: Sequence[str] = ()) -> list[str]:
    """``argv`` with the value of every secret flag and every occurrence of ``secrets`` hidden."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(HIDDEN)
            hide_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if flag in _FLAGS:
            out.append(f"{flag}={HIDDEN}" if eq else arg)
            hide_next = not eq
            continue
        for secret in secrets:
            arg = arg.replace(secret, HIDDEN)
        out.append(arg)
    return out


def without_secret_flags(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``argv`` less every secret flag and its value, and the flags left out (as typed, without values)."""
    kept: list[str] = []
    dropped: list[str] = []
    skip_next = False
    for arg in argv:
        if skip_next:
            skip_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if flag in _FLAGS:
            dropped.append(flag)
            skip_next = not eq
            continue
        kept.append(arg)
    return kept, dropped


@contextmanager
def argv_redacted(secrets: Sequence[str] = ()) -> Iterator[None]:
    """``sys.argv`` redacted for the duration (for a library that records it, like wandb's init)."""
    saved = sys.argv
    sys.argv = redact_argv(saved, secrets)
    try:
        yield
    finally:
        sys.argv = saved
