"""``exl3rt``: entry point and sub-command table.

Each sub-command lives in its own module with ``add_parser(subparsers)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

from safetensors import SafetensorError  # a corrupt file met past the header checks (e.g. inside transformers)

from .. import __version__, env
from ..cache.errors import CacheError
from ..encode.errors import EncodeError
from ..format.errors import FormatError
from ..runtime.config import Exl3ConfigError
from ..util.tensorfiles import TensorFileError
from . import cache, evaluate, example, generate, inspect, quantize
from ._args import UsageError

COMMANDS = (generate, evaluate, quantize, inspect, cache, example)

DESCRIPTION = """\
exl3rt reads, writes and runs LLM weights quantized as EXL3 trellis codes (the ExLlamaV3 format).

Try it:
  exl3rt generate                      SmolLM2-135M encoded to 4 bits on load (cached), then a reply
  exl3rt eval --bits 2 3 4 6           perplexity of each bitrate next to the unquantized model
  exl3rt example /tmp/tiny-exl3        write a small random EXL3 checkpoint
  exl3rt inspect /tmp/tiny-exl3        list its quantized layers and average bits per weight
  exl3rt quantize SRC OUT --bits 4     convert a Hugging Face checkpoint to EXL3 (resumable)
  exl3rt generate --model OUT          run that EXL3 checkpoint as stored (nothing encoded)
"""

EPILOG = "environment variables:\n" + env.describe()


def docs_dir() -> Optional[str]:
    """Where the documentation is: the source checkout this module runs from (an editable install), else the copy
    installed with the wheel (``<prefix>/share/doc/exl3rt``); None when neither is there."""
    from pathlib import Path
    for root in (Path(__file__).resolve().parents[3], Path(sys.prefix) / "share" / "doc" / "exl3rt"):
        if (root / "docs" / "architecture.md").is_file():
            return str(root)
    return None


def build_parser() -> argparse.ArgumentParser:
    where = docs_dir()
    epilog = EPILOG + (f"\ndocumentation: {where}/README.md and {where}/docs/" if where else "")
    parser = argparse.ArgumentParser(prog="exl3rt", description=DESCRIPTION, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"exl3rt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in COMMANDS:
        cmd.add_parser(sub)
    return parser


def _one_line(exc: BaseException) -> str:
    """The error's message on one line (some libraries' messages span several)."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        logging.basicConfig(level=env.LOG_LEVEL.get(), format="exl3rt: %(message)s")
        if args.command is None:
            parser.print_help()
            return 2
        status = int(args.run(args) or 0)
        sys.stdout.flush()                # a closed pipe shows here rather than in the interpreter's exit
        return status
    except (FormatError, EncodeError, TensorFileError, env.EnvError, CacheError, Exl3ConfigError, UsageError,
            SafetensorError) as exc:
        print(f"exl3rt: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # the reader went away (``exl3rt inspect ... | head``): stop quietly, as a tool killed by SIGPIPE would
        # (status 128 + 13); stdout goes to /dev/null so that the interpreter's last flush cannot raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:                # a file or folder the command cannot read or write: say which, in one line
        print(f"exl3rt: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:      # Ctrl-C: one line (with what the command kept, if it says), status 130
        notes = getattr(exc, "__notes__", None) or []
        print("exl3rt: interrupted" + "".join(f"; {n}" for n in notes), file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
