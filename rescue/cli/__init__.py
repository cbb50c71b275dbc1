"""The `rescue` command: each subcommand parses, calls one library function, prints.

This module holds the entry point; `console` the console and every exit code; each command group (study,
manifest, analysis, service, servers) keeps its parsers beside its handlers, so a new flag is one file.
"""

from __future__ import annotations

import argparse
import sys

from rescue import __version__
from rescue.cli.console import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_PEER


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows an option's default, unless it has none or its help already says which."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="rescue", description="VLM-assisted failure rescue for robot-policy evaluation")
    parser.add_argument("-v", "--verbose", action="store_true", help="show every event on the terminal")
    parser.add_argument("--version", action="version", version=f"rescue {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    # Every option's help shows its default.
    _add = sub.add_parser

    def add_parser(name: str, **kwargs):
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        return _add(name, **kwargs)

    sub.add_parser = add_parser  # type: ignore[method-assign]

    from rescue.cli import analysis, manifest, servers, service, study

    for group in (study, manifest, analysis, service, servers):
        group.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rescue` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    import sqlite3

    from rescue.core.configuration.config_files import ConfigError
    from rescue.core.failfast import PeerUnreachable
    from rescue.core.configuration.identity import IdentityError
    from rescue.core.inputs import InputFileError
    from rescue.core.manifest import ManifestError
    from rescue.env.backend import BackendError
    from rescue.study import logs
    from rescue.study.folder import StudyError
    from rescue.study.journal import JournalError
    from rescue.study.layout import LayoutError

    logs.configure(None, args.verbose)
    try:
        return args.func(args)
    except ManifestError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return EXIT_BAD_INPUT
    except (StudyError, IdentityError, ConfigError, InputFileError, JournalError, LayoutError, BackendError) as exc:
        print(f"rescue: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except PeerUnreachable as exc:
        print(f"rescue: {exc}", file=sys.stderr)
        return EXIT_PEER
    except sqlite3.Error as exc:
        print(f"rescue: the study's journal cannot be used: {exc}", file=sys.stderr)
        return EXIT_INTERNAL
    except OSError as exc:
        # A full disk mid-run lands here: the case in flight stays claimed, and `rescue resume`
        # records it unknown (interrupted) once there is space again.
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"rescue: {exc.strerror or exc}{where}", file=sys.stderr)
        return EXIT_INTERNAL
    except KeyboardInterrupt:
        print("rescue: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # never a traceback for a user; -v shows it
        if args.verbose:
            raise
        print(f"rescue: internal error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
              "(run with -v for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL
