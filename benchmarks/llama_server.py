#!/usr/bin/env python
"""Print the path of llama.cpp's ``llama-server``, building it first if it is not cached.

The build itself is ``harness/llama_build.py`` (its docstring says how and why); the
benchmarks that run llama-server call it before anything is timed.
"""

from __future__ import annotations

import argparse

from harness import llama_build


def main() -> None:
    ap = argparse.ArgumentParser(
        description=llama_build.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.parse_args()
    print(llama_build.ensure_llama_server())


if __name__ == "__main__":
    main()
