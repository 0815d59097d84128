"""The ASGI app multi-tokenizer HTTP workers import (via SGLANG_HTTP_SERVER_APP_PATH).

sglang 0.5.23 starts these workers without calling load_plugins(), so the
tokenizer-side patches would be missing there. Loading plugins on import, before
the real app module is imported, makes them active; the TokenizerWorker built
in the app's lifespan is then verified like every other process role.
"""

import importlib
import os

from sglang.srt.plugins import load_plugins

load_plugins()

from sglang_dsv41.loader import INNER_APP_PATH_ENV, STOCK_APP_PATH  # noqa: E402

_module, _, _attr = os.environ.get(INNER_APP_PATH_ENV, STOCK_APP_PATH).partition(":")
app = getattr(importlib.import_module(_module), _attr or "app")
