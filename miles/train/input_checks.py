"""Run every input check and report every refusal at once, instead of one per launch (the run plan,
:mod:`miles.train.plan`, that the dry run prints and the real run runs).

    errors = collect_errors(lambda: load_prompts(path), lambda: check_run_dir(...))
    if errors:
        raise ValueError(join_errors(errors))

One refusal is its own message; several are listed, one a line.
"""

from __future__ import annotations

from collections.abc import Callable


def collect_errors(*checks: Callable[[], object]) -> list[str]:
    """The messages of the checks that raise ``ValueError`` or ``FileNotFoundError``, in order; an
    error that lists several problems (its ``problems``, e.g. a reward's files) gives each its line."""
    errors = []
    for check in checks:
        try:
            check()
        except (ValueError, FileNotFoundError) as e:
            errors += getattr(e, "problems", None) or [str(e)]
    return errors


def join_errors(errors: list[str]) -> str:
    """One message: the error itself, or ``N inputs the run would refuse:`` and one line each."""
    if len(errors) == 1:
        return errors[0]
    return f"{len(errors)} inputs the run would refuse (fix them all before launching):\n" + "\n".join(
        f"  - {e}" for e in errors
    )
