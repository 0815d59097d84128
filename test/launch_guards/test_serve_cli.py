"""The real `sglang serve` entry point refuses a known-crash command before any
process starts: one line naming the flags, exit status 1, no traceback.

The console script's `main` runs in a fresh interpreter with the platform
overridden to CUDA (the only thing mocked: this machine has no GPU); sglang
loads this package through its entry point as on a GPU node.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

import sglang_dsv41
from conftest import run_python

TINY = Path(sglang_dsv41.__file__).parent / "data" / "tiny_dsv41"
REFUSAL = "[sglang-dsv41] refusing to start: --enable-decoder-swa-bounded-replay was given"


@pytest.mark.timeout(600)
def test_sglang_serve_refuses_explicit_replay_with_dp_attention_and_dspark(tmp_path):
    config = json.loads((TINY / "config.json").read_text())
    marker = json.loads((TINY / "dspark_draft_marker.json").read_text())
    config.update({k: v for k, v in marker.items() if not k.startswith("_")})
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["sglang", "serve", "--model-path", str(tmp_path), "--device", "cuda",
            "--tp", "8", "--ep-size", "8", "--dp-size", "8", "--enable-dp-attention", "--enable-dp-lm-head",
            "--speculative-algorithm", "DSPARK", "--speculative-dspark-block-size", "5",
            "--enable-decoder-swa-bounded-replay"]
    code = textwrap.dedent(f"""
        import sys
        from sglang.srt.runtime_context import override_platform
        from sglang.cli.main import main

        sys.argv = {argv!r}
        with override_platform(is_cuda=True, is_hip=False):
            sys.exit(main())
    """)
    proc = run_python(code, timeout=560)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-4000:])
    refusal_lines = [line for line in proc.stderr.splitlines() if REFUSAL in line]
    assert len(refusal_lines) == 1, proc.stderr[-4000:]
    line = refusal_lines[0]
    assert line.startswith("[sglang-dsv41] refusing to start:")
    assert "dp + dspark cannot use --enable-decoder-swa-bounded-replay" in line
    assert "remove --enable-decoder-swa-bounded-replay" in line
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    # The interpreter's exit message is the last thing written: nothing ran after it.
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()][-1] == line
