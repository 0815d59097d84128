"""Start and read one real sglang Mooncake PD pair (test/mooncake_nvlink/_pd_pair.py) from a test."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PAIR = REPO_ROOT / "test" / "mooncake_nvlink" / "_pd_pair.py"
# The CPU Mooncake wheel keeps tcp under the NVLink flag, so the engine itself works.
NVLINK_ON_TCP = {"MOONCAKE_PROTOCOL": "tcp", "MC_INTRANODE_NVLINK": "1", "SGLANG_HOST_IP": "127.0.0.1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_llama_config(where: Path) -> str:
    """A model folder with only a config: the pair builds its pools from it, never weights."""
    model = where / "tiny_llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "torch_dtype": "float32",
    }))
    return str(model)


def start_pair(mode: str, cfg: dict, *, plugin: bool = True) -> subprocess.Popen:
    """The pair's two processes in ``mode``; ``plugin=False`` runs stock sglang."""
    env = dict(os.environ)
    env.pop("SGLANG_DSV41_ALLOW_DRIFT", None)
    env.pop("SGLANG_PLUGINS", None)
    env.update(NVLINK_ON_TCP)
    if not plugin:
        env["SGLANG_PLUGINS"] = "not-dsv41"  # stock sglang: no plugin loads
    return subprocess.Popen(
        [sys.executable, str(PAIR), mode, json.dumps(cfg)], env=env, cwd=REPO_ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def collect(proc: subprocess.Popen) -> dict:
    """The pair's RESULT line, with a clear failure when a side reported nothing or an error."""
    out, err = proc.communicate(timeout=420)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result (rc={proc.returncode}); stderr tail:\n{err[-4000:]}"
    res = json.loads(lines[-1][len("RESULT "):])
    for role in ("prefill", "decode"):
        assert role in res, f"{role} reported nothing; stderr tail:\n{err[-4000:]}"
        assert "error" not in res[role], f"{role}: {res[role]['error']}\n{err[-4000:]}"
    return res
