"""AIME 2025 avg@8 evaluation: `beam-rl eval` (see beam_rl/eval/run.py); defaults to math-ai/aime25."""

import sys

from beam_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))
