"""The ``qshard`` command line: one sub-command per job.

Sub-commands are registered in ``_COMMANDS`` as ``name -> (help, module:function)``. The module
is imported only when its command runs, so ``qshard --help`` stays fast (no torch import). The
named function receives the remaining arguments and returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

_COMMANDS: dict[str, tuple[str, str]] = {
    "version": ("print the qshard and torch versions", "qshard.cli:_version_main"),
    "train": ("train a small GPT with ZeRO++ on local ranks", "qshard.train.cli:main"),
    "report": ("plot the metrics of qshard train runs (PNG)", "qshard.train.report:main"),
}


def _version_main(argv: Sequence[str]) -> int:
    argparse.ArgumentParser(prog="qshard version").parse_args(list(argv))
    from qshard._version import __version__

    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover - torch is a hard dependency
        torch_version = "not installed"
    print(f"qshard {__version__} (torch {torch_version})")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qshard",
        description="Quantized, communication-efficient sharded training for PyTorch.",
    )
    parser.add_argument("-V", "--version", action="store_true", help="same as `qshard version`")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, _) in _COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``qshard COMMAND [ARGS...]`` (``argv`` defaults to ``sys.argv[1:]``) and return
    the exit code; ``qshard --help`` lists the commands."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] in ("-V", "--version"):  # the flag users try first, as the sub-command
        argv[0] = "version"
    name, rest = argv[0], argv[1:]
    if name not in _COMMANDS:
        parser.error(f"unknown command {name!r}; choose from {', '.join(_COMMANDS)}")
    module_name, func_name = _COMMANDS[name][1].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
