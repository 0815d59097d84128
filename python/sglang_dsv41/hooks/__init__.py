"""Thin adapters from sglang 0.5.23 call sites to the logic in ``sglang_dsv41.core``.

Every callable here is named by exactly one entry of ``sglang_dsv41.patch_table``.
"""
