"""The role status line shows whatever the root logger's level, and only once.

sglang's multi-tokenizer HTTP workers and its detokenizer router leave the root
logger at WARNING; the plugin's own logger carries a handler of its own there.
Where the root logger prints INFO the line must not show twice, and the plugin
must never configure the user's root logger.
"""

from __future__ import annotations

import json

import pytest

from conftest import run_python

pytestmark = pytest.mark.timeout(600)

CODE = """
import json, logging
root = logging.getLogger()
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang_dsv41.plugin.verify import verify_role
from sglang_dsv41.plugin.spec import Role
after_load = {
    "root_level": root.level,
    "ours_on_root": any(hasattr(h, "_sglang_dsv41_own_handler") for h in root.handlers),
}
verify_role(Role.LAUNCHER)  # root at WARNING with no handler, as in a tokenizer worker
logging.basicConfig(level=logging.INFO)  # as sglang's configure_logger does elsewhere
verify_role(Role.SCHEDULER)
print("RESULT" + json.dumps(after_load))
"""


def test_status_line_shows_once_with_the_root_logger_quiet_or_verbose():
    proc = run_python(CODE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after_load = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))[6:])
    # The root logger is left to sglang and the user: at WARNING, none of our handlers on it.
    assert after_load == {"root_level": 30, "ours_on_root": False}
    lines = [l for l in proc.stderr.splitlines() if "[sglang-dsv41] role=" in l]
    assert sum("role=launcher " in l for l in lines) == 1, proc.stderr[-3000:]
    assert sum("role=scheduler " in l for l in lines) == 1, proc.stderr[-3000:]
