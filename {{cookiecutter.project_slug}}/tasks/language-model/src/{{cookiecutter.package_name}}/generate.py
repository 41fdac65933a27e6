"""The `python -m PACKAGE.generate` command; the code is the task's own, in task/generate.py."""

import sys

from .task.generate import main

if __name__ == "__main__":
    sys.exit(main())
