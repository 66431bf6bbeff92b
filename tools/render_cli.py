"""Writes docs/cli.md from the `jaxmtp` command line's own parser: its --help text and each
subcommand's, at a fixed width of 100 columns, so that the page says what the code does.

    python tools/render_cli.py           # writes docs/cli.md
    python tools/render_cli.py --check   # exit status 1 if docs/cli.md is not what this renders
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "cli.md"
COLUMNS = "100"

INTRO = """\
# Command line

The `jaxmtp` command and its subcommands, each with its `--help` text. Options that are left out
take the default their help shows. A bad argument or input file is reported in one line naming it,
with exit status 2; `jaxmtp --debug COMMAND ...` shows the traceback too.

This page is generated from the parser in `jaxmtp/cli.py` by `python tools/render_cli.py`; the
tests check that it is current.
"""

# Where a default is the bundled demo model, the help shows this instead of the path of the
# checkout or installation it was rendered in.
DEMO_MODEL_SHOWN = "jaxmtp.DEMO_MODEL"


@contextlib.contextmanager
def _fixed_terminal():
    """COLUMNS=100 and no colour while the help is formatted; the environment as it was after."""
    saved = {name: os.environ.get(name) for name in ("COLUMNS", "NO_COLOR", "FORCE_COLOR")}
    os.environ.update(COLUMNS=COLUMNS, NO_COLOR="1")
    os.environ.pop("FORCE_COLOR", None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _parser() -> argparse.ArgumentParser:
    """The command line's parser, with the demo model's path shown by name."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # this checkout's jaxmtp, also when run as a script
    import jaxmtp
    from jaxmtp import cli

    parser = cli.build_parser()
    for sub in [parser, *_subcommands(parser).values()]:
        for action in sub._actions:
            if action.default == jaxmtp.DEMO_MODEL:
                action.default = DEMO_MODEL_SHOWN
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """{name: parser} of the subcommands, in the order they were added."""
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def render() -> str:
    """The text of docs/cli.md."""
    with _fixed_terminal():
        parser = _parser()
        sections = [INTRO, "## jaxmtp\n\n```text\n" + parser.format_help().rstrip() + "\n```\n"]
        for name, sub in _subcommands(parser).items():
            sections.append(f"## jaxmtp {name}\n\n```text\n{sub.format_help().rstrip()}\n```\n")
    return "\n".join(sections)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md is stale; write nothing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else None
        if current != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python tools/render_cli.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
