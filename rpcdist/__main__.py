"""``python -m rpcdist``: the installed version, and where the programs are.

    python -m rpcdist --version     prints "rpcdist <version>" (rpcdist.__version__)
"""

from __future__ import annotations

import argparse
import sys

import rpcdist

PROGRAMS = """programs:
  rpcdist-run      start a program's workers (torchrun's flags; also python -m rpcdist.run)
  rpcdist-server   a standalone store (also python -m rpcdist.programs.server)
  rpcdist-worker   a generic worker serving imported functions (also python -m rpcdist.programs.worker)"""


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the command line); the exit code."""
    ap = argparse.ArgumentParser(
        prog="python -m rpcdist",
        description="rpcdist: torch.distributed's RPC, RRefs and collectives over gRPC and asyncio.",
        epilog=PROGRAMS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", action="version", version=f"rpcdist {rpcdist.__version__}")
    ap.parse_args(argv)
    ap.print_help(sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
