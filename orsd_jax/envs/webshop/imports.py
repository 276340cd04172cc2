"""Importing a library without the heavy optional backends it would pull in.

bm25s imports JAX when it is installed and runs a JAX op at import time (for a top-k backend we
do not use); spaCy's thinc imports torch when installed (for model types we do not use). In an
environment worker either would cost seconds and memory for nothing, and starting JAX there
could claim accelerator memory. So those backends are made to look uninstalled while the
library is imported, unless the process already runs them.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType


def import_without(module: str, *hidden: str) -> ModuleType:
    if module in sys.modules:
        return sys.modules[module]
    masked = [name for name in hidden if name not in sys.modules]
    for name in masked:
        # `import name` now raises ImportError, which these libraries expect (documented Python behaviour;
        # typeshed types sys.modules values as modules only).
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        return importlib.import_module(module)
    finally:
        for name in masked:
            if sys.modules.get(name, ...) is None:
                del sys.modules[name]
