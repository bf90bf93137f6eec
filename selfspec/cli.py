"""The `selfspec` command line."""

from __future__ import annotations

import argparse
import sys

from . import SUPPORTED_ARCHITECTURES, __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="selfspec", description="Exact self-speculative decoding for causal LMs.")
    parser.add_argument("--version", action="version", version=f"selfspec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="complete held-out code prompts with the bundled demo target")
    demo.add_argument("--model", help="a model folder to use instead of the bundled demo target")
    demo.add_argument("--heads", help="a heads folder to use instead of the bundled heads")
    commands.add_parser("architectures", help="list the supported model types")
    args = parser.parse_args(argv)
    if args.command == "architectures":
        print("\n".join(sorted(SUPPORTED_ARCHITECTURES)))
        return 0
    if args.command == "demo":
        print(
            "selfspec demo: not built yet. The bundled demo target and its trained heads are still being trained "
            "(issue: the bundled demo). Run the tests to see the engine at work: pip install -e '.[dev]' && pytest",
            file=sys.stderr,
        )
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
