"""`python -m candle_vllm` and the `candle-vllm` console script (`candle_vllm.__main__:main`)."""

from __future__ import annotations

import sys

from candle_vllm.api.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
