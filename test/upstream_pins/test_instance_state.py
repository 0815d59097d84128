"""Upstream objects this package keeps per-object state on must have an instance dict.

The owner router keeps each request's image table in its MultimodalInputs
(OWN-FENCE); the Mooncake routing keeps its state in the KV manager
(MC-NVL-REGIONS). Both are plain attribute stores in the instance dict, so a
release that gives either class ``__slots__`` must fail here first.
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "module, name",
    [
        ("sglang.srt.managers.schedule_batch", "MultimodalInputs"),
        ("sglang.srt.disaggregation.mooncake.conn", "MooncakeKVManager"),
    ],
)
def test_instances_keep_a_dict(module, name):
    import importlib

    cls = getattr(importlib.import_module(module), name)
    assert cls.__dictoffset__ != 0, f"{module}.{name} instances have no __dict__"


def test_multimodal_inputs_take_an_attribute():
    from sglang.srt.managers.schedule_batch import MultimodalInputs

    inputs = MultimodalInputs(mm_items=[])
    inputs.__dict__["_sglang_dsv41_probe"] = 1
    assert inputs._sglang_dsv41_probe == 1
    assert inputs == MultimodalInputs(mm_items=[])  # dataclass equality reads fields only
