"""The `keras-ft` command: `keras-ft demo [...]`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: keras-ft demo [--help]\n\n"
            "  demo   kill a training with SIGKILL and watch it resume"
        )
        return 0 if argv else 2
    if argv[0] == "demo":
        from keras_ft import demo

        return demo.main(argv[1:])
    print(
        f"keras-ft: unknown command {argv[0]!r}; try `keras-ft --help`.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
