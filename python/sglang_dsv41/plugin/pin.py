"""The one place that names the sglang release this package was written against."""

PINNED_SGLANG_VERSION = "0.5.23"
ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "dsv41"
DISTRIBUTION_NAME = "sglang-dsv41"
ALLOW_DRIFT_ENV = "SGLANG_DSV41_ALLOW_DRIFT"
