"""A command's start: the garbage collector stays off while the command imports torch and its stack.

Those imports make about a million objects that live as long as the process; the collector's full
passes over them while they load find nothing to free and take 0.4 s of every command's start, and of
every torchrun worker's. The package imports this module first. Under `python -m PACKAGE.COMMAND`
(Python sets sys.argv[0] to "-m" while it looks for the command's module) it turns the collector
off; cli.run turns it back on with what the imports made frozen (gc.freeze), so later passes skip
those objects too. Importing the package any other way (tests, notebooks, other programs) leaves
the collector alone.
"""

from __future__ import annotations

import gc
import sys

_paused = sys.argv[:1] == ["-m"] and gc.isenabled()
if _paused:
    gc.disable()


def imports_done() -> None:
    """Turn the collector back on if this module turned it off, with the imports' objects frozen."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
