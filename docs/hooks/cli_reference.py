"""MkDocs hook: the command-line reference, rendered from `hf-longctx`'s own argument parser.

docs/reference/cli.md holds the marker `<!-- cli-help -->`; at build time it becomes one
section per command (`hf-longctx --help`, then every subcommand's `--help`), each the text
argparse prints at a fixed width of 100 columns. A new subcommand or flag appears without
an edit; a page without the marker is a warning (a failure under `--strict`)."""

from __future__ import annotations

import argparse
import logging

PAGE = "reference/cli.md"
MARKER = "<!-- cli-help -->"
WIDTH = 100


def _help(parser: argparse.ArgumentParser) -> str:
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=WIDTH, max_help_position=36)
    return parser.format_help().rstrip()


def render() -> str:
    """Markdown: `hf-longctx --help` and each subcommand's help, as text blocks."""
    from hf_longctx.cli import build_parser

    parser = build_parser()
    parts = [f"## `hf-longctx`\n\n```text\n{_help(parser)}\n```"]
    for action in parser._actions:  # argparse keeps its subcommands on a _SubParsersAction
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                parts.append(f"## `hf-longctx {name}`\n\n```text\n{_help(sub)}\n```")
    return "\n\n".join(parts)


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        logging.getLogger("mkdocs.hooks.cli_reference").warning(f"{PAGE} has no {MARKER} marker")
        return markdown
    return markdown.replace(MARKER, render())
