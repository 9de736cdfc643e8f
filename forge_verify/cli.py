"""The ``forge-verify`` command."""

import argparse
import os
import sys

from .check import PROFILE_VARIABLE, run_check


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="forge-verify", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="run the exactness properties and print a verdict table "
                                              "(GPU when present, else the Triton CPU interpreter)")
    check.add_argument("--profile", default=None,
                       help=f"hypothesis profile (dev, ci, nightly); default: ${PROFILE_VARIABLE} or ci")
    check.add_argument("-k", dest="keyword", default=None, help="only properties matching this pytest -k expression")
    args = parser.parse_args(argv)

    if args.command == "check":
        # The main job is deterministic unless asked otherwise.
        os.environ[PROFILE_VARIABLE] = args.profile or os.environ.get(PROFILE_VARIABLE, "ci")
        extra = ["-k", args.keyword] if args.keyword else []
        return run_check(extra_args=extra)
    return 2


if __name__ == "__main__":
    sys.exit(main())
