"""The same server with the plugin filtered out by sglang's own ``SGLANG_PLUGINS``.

No process prints a plugin line, and stock sglang 0.5.23 admits the override
request with an image that the plugin refuses (``test_e2e_single.py``): the
patch, not the set-up, is what changes the answer.
"""

from __future__ import annotations

import pytest

from _e2e_server import PLUGIN_MARK, Server, override_with_media, start_healthy, tiny_model  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = Server(tiny_model, tmp_path_factory.mktemp("stock"), embedding=True, plugin=False)
    start_healthy(srv)
    yield srv
    srv.stop()
    print(f"\nstock server: /health after {srv.healthy_after_s:.0f} s")


def test_stock_admits_override_with_media(server):
    resp = server.post("/v1/embeddings", override_with_media(server.model))
    assert resp.status_code == 200, resp.text
    assert [len(item["embedding"]) for item in resp.json()["data"]] == [64, 64]


def test_stock_batch_with_one_override_object_is_a_server_error(server):
    """What the plugin's EMB-BATCH patches turn into a 400: sglang's own batch split fails."""
    sent = {"embeds": [[0.25] * 64], "positions": [1]}
    resp = server.post("/encode", {"text": ["the lazy dog", "a quick fox"], "positional_embed_overrides": sent})
    assert resp.status_code == 500, resp.text
    assert server.post("/encode", {"text": "the lazy dog"}).status_code == 200


def test_no_plugin_line_in_any_process(server):
    resp = server.post("/v1/embeddings", override_with_media(server.model, with_image=False))
    assert resp.status_code == 200, resp.text
    assert PLUGIN_MARK not in server.log()


def test_no_stand_in_kernel_was_called(server):
    assert not server.kernel_calls.exists(), server.kernel_calls.read_text()
