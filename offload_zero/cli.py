"""Command-line entry point: ``offload-zero <command> [flags]``.

Commands are registered in :data:`COMMANDS` as ``(name, help, module)``; a command module
provides ``DESCRIPTION`` (text for its ``--help``),
``add_arguments(parser)`` and ``run(args)``: ``train`` (the main job) and ``estimate`` (memory
per device, host and NVMe for a model, world size, stage and offload choice) and ``bench``
(the swapper's read/write bandwidth on a folder's filesystem).

Exit status: 0 on success, 2 on bad flags (argparse) or on a ``ValueError`` /
``NotImplementedError`` raised by the run (printed as one line, no traceback), 130 on Ctrl-C.
"""
from __future__ import annotations

import argparse
import glob
import importlib
import logging
import os
import signal
import sys
from typing import List, Optional

PROG = "offload-zero"

# (name, one-line help, module providing DESCRIPTION, add_arguments(parser) and run(args))
COMMANDS = [
    ("train", "train a Llama-style model from scratch, or fine-tune a local Hugging Face "
              "checkpoint, with ZeRO stage 1/2/3 and CPU/NVMe offload",
     "offload_zero.train"),
    ("estimate", "memory per device, host and NVMe for a model, world size, ZeRO stage and "
                 "offload choice (the ZeRO paper's arithmetic plus this engine's buffers), and "
                 "whether each placement fits a machine, activations included",
     "offload_zero.fit"),
    ("bench", "measure the NVMe tier: the swapper's read and write GB/s on a file under a folder",
     "offload_zero.bench"),
]

_EPILOG = """\
examples:
  offload-zero train                                   # default preset, stdlib corpus, CPU offload
  offload-zero train --offload nvme --path /mnt/nvme/swap --json run.json
  offload-zero train --model ./my-checkpoint --data notes/ --steps 200 --dtype bf16 --save ./tuned
  torchrun --nproc-per-node 2 -m offload_zero.cli train --stage 3

Run 'offload-zero <command> --help' for a command's flags.
"""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, ``<prog>: error: <message> (see '<prog>
    --help')``, without the usage block before them; exit status 2 as argparse's."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per entry of :data:`COMMANDS` (bad flags: one
    line on stderr, exit status 2)."""
    parser = _Parser(
        prog=PROG,
        description="ZeRO stage 1/2/3 training for PyTorch with parameters, gradients and "
                    "optimizer state offloaded to host memory or NVMe.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, help_text, module_name in COMMANDS:
        module = importlib.import_module(module_name)
        cmd = sub.add_parser(name, help=help_text, description=module.DESCRIPTION,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(cmd)
        cmd.set_defaults(_module=module)
    return parser


def _explicit_flags(argv: Optional[List[str]]) -> set:
    """The dests of the flags ``argv`` gives (not their defaults): parsed again with every
    default suppressed."""
    parser = build_parser()
    commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for sub in commands[0].choices.values():
        for action in sub._actions:
            action.default = argparse.SUPPRESS
    given = vars(parser.parse_args(argv))
    return set(given) - {"command", "_module"}


def _cleanup(args) -> str:
    """What an interrupted command cleaned up, for its last line: only the commands that write
    swap or test files have any. Files still under ``--path`` (a clean-up cut short) are named
    instead: the next run refuses to overwrite them."""
    if args.command == "estimate":
        return ""
    path = getattr(args, "path", None)
    left = sorted(glob.glob(os.path.join(glob.escape(path), "**", "*.swp"), recursive=True)) \
        if path else []
    if left:
        return f"; {len(left)} swap file(s) left under {path} (such as {left[0]}): remove them"
    return "; swap files removed"


def main(argv: Optional[List[str]] = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.explicit_flags = _explicit_flags(argv)
    logging.basicConfig(level=logging.INFO, format=f"{PROG}: %(levelname)s: %(message)s")
    # SIGTERM (torchrun, Slurm, docker stop) unwinds like Ctrl-C, so every `with` block closes
    # and swap files and temporary folders are removed.
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        args._module.run(args)
    except (ValueError, NotImplementedError) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"{PROG} {args.command}: error: {message}", file=sys.stderr)
        return 2
    except _Terminated:
        print(f"{PROG} {args.command}: terminated (SIGTERM){_cleanup(args)}", file=sys.stderr)
        return _exiting(argv, 143)
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted (Ctrl-C){_cleanup(args)}", file=sys.stderr)
        return _exiting(argv, 130)
    finally:
        if signal.getsignal(signal.SIGTERM) is _terminate:  # (not once _exiting ignores it)
            signal.signal(signal.SIGTERM, previous)
    return 0


def _exiting(argv, code: int) -> int:
    """Run as the program (``argv`` None) and interrupted: the process is about to exit, so a
    further Ctrl-C or SIGTERM is ignored. One landing in the interpreter's exit handlers (an
    engine's finalizer, torch's) printed a traceback after the last line, or cut short a
    finalizer's file removal. Called with ``argv`` (from Python), nothing changes. Returns
    ``code`` (the exit status)."""
    if argv is None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return code


class _Terminated(BaseException):
    """Raised in the main thread when SIGTERM arrives."""


def _terminate(signum, frame):
    raise _Terminated()


if __name__ == "__main__":
    sys.exit(main())
