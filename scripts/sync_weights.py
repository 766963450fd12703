"""Push new weights into running vLLM servers, all or nothing: `beam-rl sync` (see beam_rl/sync/run.py)."""

import sys

from beam_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["sync", *sys.argv[1:]]))
