"""A real ``sglang serve --is-embedding`` with the plugin and one tokenizer (in the launcher).

The embedding-override admission patch refuses, through the real HTTP API, a
request that carries overrides together with an image, and still serves the
same overrides without the image. Overrides posted as JSON in
``positional_embed_overrides`` (which sglang never turns into the object its
scheduler expects, and which stops a stock server's scheduler) get a 400 and the
server keeps serving. ``test_e2e_stock.py`` sends the same
requests to a server started with the plugin filtered out.
"""

from __future__ import annotations

from collections import Counter

import pytest

from _e2e_server import Server, override_with_media, start_healthy, tiny_model  # noqa: F401
from sglang_dsv41.embed_overrides.rules import ADMISSION_ERROR, BATCH_OVERRIDE_FORM_ERROR, OVERRIDE_FORM_ERROR
from sglang_dsv41.plugin.spec import Role
from sglang_dsv41.plugin.table import owed_to

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

EXPECTED_ROLES = {Role.LAUNCHER.value: 1, Role.SCHEDULER.value: 1, Role.DETOKENIZER.value: 1}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = Server(tiny_model, tmp_path_factory.mktemp("single"), embedding=True)
    start_healthy(srv)
    srv.wait_for_roles(EXPECTED_ROLES, timeout=300)
    yield srv
    srv.stop()
    print(f"\nsingle-tokenizer server: /health after {srv.healthy_after_s:.0f} s")


def test_override_with_media_is_refused_through_http(server):
    resp = server.post("/v1/embeddings", override_with_media(server.model))
    assert resp.status_code == 400, resp.text
    assert ADMISSION_ERROR in resp.text


def test_override_without_media_is_served(server):
    resp = server.post("/v1/embeddings", override_with_media(server.model, with_image=False))
    assert resp.status_code == 200, resp.text
    data = resp.json()["data"]
    assert len(data) == 2
    for item in data:
        assert len(item["embedding"]) == 64 and all(isinstance(x, float) for x in item["embedding"])


@pytest.mark.parametrize("route", ["/encode", "/generate"])
def test_json_overrides_without_media_are_refused_and_the_server_keeps_serving(server, route):
    sent = {"embeds": [[0.25] * 64], "positions": [1]}
    resp = server.post(route, {"text": "the lazy dog", "positional_embed_overrides": sent})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"] == OVERRIDE_FORM_ERROR.format(kind="dict")
    plain = server.post("/encode", {"text": "the lazy dog"})
    assert plain.status_code == 200, plain.text
    assert len(plain.json()["embedding"]) == 64


@pytest.mark.parametrize("route", ["/encode", "/generate"])
def test_batch_with_one_override_object_is_refused_and_the_server_keeps_serving(server, route):
    """sglang's batch split indexes the field per prompt: one object for the batch was a 500."""
    sent = {"embeds": [[0.25] * 64], "positions": [1]}
    resp = server.post(route, {"text": ["the lazy dog", "a quick fox"], "positional_embed_overrides": sent})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"] == BATCH_OVERRIDE_FORM_ERROR.format(index=0, kind="dict")
    plain = server.post("/encode", {"text": ["the lazy dog", "a quick fox"]})
    assert plain.status_code == 200, plain.text
    assert [len(item["embedding"]) for item in plain.json()] == [64, 64]


def test_each_role_prints_one_status_line(server):
    lines = server.status_lines()
    assert Counter((line.role, line.pid) for line in lines).most_common(1)[0][1] == 1
    assert dict(Counter(line.role for line in lines)) == EXPECTED_ROLES, server.log_tail()
    for line in lines:
        owed = len(owed_to(Role(line.role)))
        assert (line.applied, line.owed) == (owed, owed), line
    assert {line.pid for line in lines if line.role == Role.LAUNCHER.value} == {server.pid}


def test_no_stand_in_kernel_was_called(server):
    assert not server.kernel_calls.exists(), server.kernel_calls.read_text()
