"""The `python -m PACKAGE.prepare` command; the code is the task's own, in task/prepare/."""

import sys

from .task.prepare import main

if __name__ == "__main__":
    sys.exit(main())
