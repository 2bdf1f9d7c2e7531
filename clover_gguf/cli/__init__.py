"""``clover-gguf`` command line: run, chat, compare, info, logits, bench, serve, fit, convert,
one module per subcommand (each with ``add_parser`` and ``cmd``), what they share in
:mod:`.common`. A thin shell over :class:`clover_gguf.Model` and :class:`clover_gguf.Clover`
(flags map one to one onto API arguments, :mod:`clover_gguf.options`). Never imports torch.
Exit codes: 0 ok, 1 runtime error, 2 bad arguments or unreadable/invalid files, 130 on
Ctrl-C.
"""
from __future__ import annotations

import argparse
import os
import sys

from . import bench, chat, compare, convert, fit, info, logits, run, serve
from .common import EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, UsageError, err, set_color


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = argparse.ArgumentParser(
        prog="clover-gguf",
        description="Run Clover block-diffusion (and Qwen3.5/3.6-MoE) models from GGUF files.",
    )
    p.add_argument("--version", action="version", version=f"clover-gguf {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{run,chat,compare,info,logits,bench,serve,fit,convert}")
    sub.required = True

    for module in (run, info, logits, chat, compare, bench, serve, fit, convert):
        module.add_parser(sub)
    p.set_defaults(subcommands=sub.choices)
    return p


def check_word_flags(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Refuse a single-dash word that is not a flag of the subcommand (UsageError naming it):
    argparse would read it as a short flag and its value (``-cnv`` as ``-c nv``), where
    llama.cpp's flags (``-cnv``, ``-ngl``, ``-fa``) are whole words."""
    if not argv:
        return
    sp = parser.get_default("subcommands").get(argv[0])
    if sp is None:
        return
    known = sp._option_string_actions  # noqa: SLF001 - argparse has no public table of its flags
    for tok in argv[1:]:
        if tok == "--":
            return
        if tok.startswith("-") and not tok.startswith("--") and len(tok) > 2 and tok[2:3].isalpha() \
                and "=" not in tok and tok not in known:
            split = f" (nor {tok[:2]} {tok[2:]})" if tok[:2] in known else ""
            raise UsageError(f"{tok}: not a flag of `clover-gguf {argv[0]}`{split}; see `clover-gguf {argv[0]} "
                             "--help`, and docs/cli.md for the llama.cpp flags it takes")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``clover-gguf``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "convert":
            try:
                return convert.cmd(argv[1:])
            except (FileNotFoundError, NotADirectoryError, ValueError) as e:
                raise UsageError(str(e)) from None
        parser = build_parser()
        check_word_flags(parser, argv)
        a = parser.parse_args(argv)
        if getattr(a, "model", "") is None:  # no -m: the small trained Clover shipped in the package
            from .. import DEFAULT_MODEL

            a.model = DEFAULT_MODEL
        set_color(getattr(a, "color", "auto"))
        return a.func(a)
    except UsageError as e:
        err(str(e))
        return EXIT_USAGE
    except KeyboardInterrupt:
        err("interrupted")
        return 130
    except BrokenPipeError:
        # stdout closed early (e.g. piped into head): not an error of ours.
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_OK
    except BaseException as e:  # runtime failure, a native library's panic included: one line, no
        # traceback (CLOVER_DEBUG=1 shows it)
        if isinstance(e, (SystemExit, GeneratorExit)) or os.environ.get("CLOVER_DEBUG"):
            raise
        err(f"{type(e).__name__}: {e}" if not str(e).startswith(type(e).__name__) else str(e))
        return EXIT_RUNTIME


if __name__ == "__main__":
    sys.exit(main())
