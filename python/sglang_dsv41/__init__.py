"""DeepSeek-V4.1 serving fixes for sglang 0.5.23, carried as an sglang plugin.

Importing this package has no side effects; sglang activates it through the
``sglang.srt.plugins`` entry point ``dsv41`` (see ``loader.activate``).
"""

__version__ = "0.1.0"
