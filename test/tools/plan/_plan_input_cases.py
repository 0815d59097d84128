"""The bad and unusual inputs of `sglang-dsv41 plan`: files, arguments, expected status and message.

Shared by test_plan_inputs.py (each through the command line) and
test_compose_differential.py (each through both compose readers).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

SERVER = """\
  server:
    image: img
    network_mode: host
    command: ["sglang", "serve", "--model-path", "/model", "--tp", "2"]
"""


def _laughs(levels: int = 9) -> str:
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for n in range(1, levels + 1):
        lines.append(f"l{n}: &l{n} [" + ", ".join([f"*l{n - 1}"] * 10) + "]")
    return "\n".join(lines) + "\nservices: {}\n"


@dataclass
class Case:
    files: dict[str, str | bytes]
    args: list[str]
    rc: int
    message: str  # a substring of one output line
    stdin: bytes | None = None
    env: dict[str, str] = field(default_factory=dict)
    stdin_closed: bool = False  # run as `plan ... <&-`


def _yaml(text: str) -> str:
    return textwrap.dedent(text)


CASES: dict[str, Case] = {
    # ---- input plan cannot read: exit 2, one line
    "missing file": Case({}, ["nope.yml"], 2, "nope.yml: no such compose file"),
    "a directory": Case({"d/x.txt": ""}, ["d"], 2, "d: not a regular file"),
    "undecodable bytes": Case({"c.yml": b"services:\n  a: {image: \"\xff\xfe\"}\n"}, ["c.yml"], 2,
                              "c.yml: not UTF-8 text (byte 0xff at offset 24)"),
    "empty file": Case({"c.yml": ""}, ["c.yml"], 2, "c.yml: a compose file is a mapping at the top level, not empty"),
    "top level list": Case({"c.yml": "- a\n- b\n"}, ["c.yml"], 2, "a compose file is a mapping at the top level, not a list"),
    "invalid yaml": Case({"c.yml": "services:\n  a: [unclosed\n"}, ["c.yml"], 2, "c.yml: not valid YAML: line"),
    "two documents": Case({"c.yml": "a: 1\n---\nb: 2\n"}, ["c.yml"], 2, "c.yml: not valid YAML"),
    "services is a list": Case({"c.yml": "services: [a, b]\n"}, ["c.yml"], 2, "c.yml: services must be a mapping, not a list"),
    "service is a string": Case({"c.yml": "services:\n  a: sglang serve\n"}, ["c.yml"], 2,
                                "c.yml: service a: a service must be a mapping, not a string"),
    "bad service name": Case({"c.yml": "services:\n  'bad name!': {image: x}\n"}, ["c.yml"], 2,
                             "'bad name!' is not a valid service name"),
    "ports is a string": Case({"c.yml": "services:\n  a: {image: x, ports: '8080:80'}\n"}, ["c.yml"], 2,
                              "c.yml: service a: ports must be a list, not a string"),
    "port is a mapping list": Case({"c.yml": "services:\n  a: {image: x, ports: [[8080, 80]]}\n"}, ["c.yml"], 2,
                                   "service a: a port must be a string, a number or a mapping, not a list"),
    "port not a number": Case({"c.yml": "services:\n  a: {image: x, ports: ['http:80']}\n"}, ["c.yml"], 2,
                              "service a: cannot read port 'http'"),
    "port out of range": Case({"c.yml": "services:\n  a: {image: x, ports: ['70000:80']}\n"}, ["c.yml"], 2,
                              "service a: port '70000' is outside 1-65535"),
    "huge port range": Case({"c.yml": "services:\n  a: {image: x, ports: ['1-99999999999:1-99999999999']}\n"},
                            ["c.yml"], 2, "service a: cannot read port"),
    "devices is a string": Case({"c.yml": _yaml("""\
        services:
          a: {image: x, deploy: {resources: {reservations: {devices: nvidia}}}}
        """)}, ["c.yml"], 2, "service a: deploy.resources.reservations.devices must be a list, not a string"),
    "device is a list": Case({"c.yml": _yaml("""\
        services:
          a: {image: x, deploy: {resources: {reservations: {devices: [[gpu]]}}}}
        """)}, ["c.yml"], 2, "service a: a reserved device must be a mapping, not a list"),
    "gpu count is a word": Case({"c.yml": _yaml("""\
        services:
          a: {image: x, deploy: {resources: {reservations: {devices: [{driver: nvidia, count: two}]}}}}
        """)}, ["c.yml"], 2, "service a: a GPU count must be a whole number or \"all\", not 'two'"),
    "deploy is a list": Case({"c.yml": "services:\n  a: {image: x, deploy: [1]}\n"}, ["c.yml"], 2,
                             "service a: deploy must be a mapping, not a list"),
    "environment is a string": Case({"c.yml": "services:\n  a: {image: x, environment: A=1}\n"}, ["c.yml"], 2,
                                    "service a: environment must be a list or a mapping, not a string"),
    "environment value is a mapping": Case({"c.yml": "services:\n  a: {image: x, environment: {A: {b: 1}}}\n"},
                                           ["c.yml"], 2, "environment 'A' must be a string, number or boolean"),
    "command is a mapping": Case({"c.yml": "services:\n  a: {image: x, command: {run: serve}}\n"}, ["c.yml"], 2,
                                 "service a: command must be a string or a list, not a mapping"),
    "labels is a number": Case({"c.yml": "services:\n  a: {image: x, labels: 3}\n"}, ["c.yml"], 2,
                               "service a: labels must be a list or a mapping, not a number"),
    "depends_on is a string": Case({"c.yml": "services:\n  a: {image: x, depends_on: b}\n"}, ["c.yml"], 2,
                                   "service a: depends_on must be a list or a mapping, not a string"),
    "unbalanced command quote": Case({"c.yml": "services:\n  a: {image: x, command: \"sglang serve 'oops\"}\n"},
                                     ["c.yml"], 2, "service a: cannot split the command"),
    "alias bomb": Case({"c.yml": _laughs()}, ["c.yml"], 2, "YAML nodes once aliases are expanded (an alias bomb?)"),
    "recursive alias": Case({"c.yml": "a: &a [1, *a]\nservices: {}\n"}, ["c.yml"], 2,
                            "the YAML alias *a refers to a node that contains it"),
    "deep nesting": Case({"c.yml": "a: " + "[" * 100 + "]" * 100 + "\n"}, ["c.yml"], 2, "nested deeper than 64 levels"),
    "file too large": Case({"c.yml": "# pad\n" * 200_000}, ["c.yml"], 2, "c.yml: larger than 1024 KiB"),
    "unset variable": Case({"c.yml": "services:\n  a: {image: \"${NOT_SET_ANYWHERE}\"}\n"}, ["c.yml"], 2,
                           "variable NOT_SET_ANYWHERE is not set and has no default"),
    "required variable message": Case({"c.yml": "services:\n  a: {image: \"${IMG:?set IMG first}\"}\n"}, ["c.yml"], 2,
                                      "variable IMG: set IMG first"),
    "bad .env line": Case({"c.yml": "services:\n  a: {image: x}\n", ".env": "JUST TEXT\n"}, ["c.yml"], 2,
                          ".env:1: not a KEY=VALUE line"),
    "undecodable .env": Case({"c.yml": "services:\n  a: {image: x}\n", ".env": b"A=\xc3\x28\n"}, ["c.yml"], 2,
                             ".env: not UTF-8 text"),
    ".env refers to an unset variable": Case({"c.yml": "services:\n  a: {image: x}\n", ".env": "A=${B}/x\n"},
                                             ["c.yml"], 2, ".env:1: variable B is not set and has no default"),
    "interpolation blow-up": Case({"c.yml": "services:\n  a: {image: x, command: \"" + "$A" * 40 + "\"}\n",
                                   ".env": "A=" + "x" * 60_000 + "\n"}, ["c.yml"], 2,
                                  "longer than 65536 characters after interpolation"),
    "extends cycle": Case({"c.yml": "services:\n  a: {extends: b}\n  b: {extends: a}\n"}, ["c.yml"], 2,
                          "extends cycle through service"),
    "extends a missing service": Case({"c.yml": "services:\n  a: {extends: ghost}\n"}, ["c.yml"], 2,
                                      "c.yml: no service named 'ghost'"),
    "include is a string of a missing file": Case({"c.yml": "include: [gone.yml]\nservices: {}\n"}, ["c.yml"], 2,
                                                  "gone.yml: no such compose file"),
    "env_file missing": Case({"c.yml": "services:\n  a: {image: x, env_file: [nope.env]}\n"}, ["c.yml"], 2,
                             "service a: env_file nope.env does not exist"),
    "bad project name": Case({"c.yml": "name: Not Valid\nservices: {}\n"}, ["c.yml"], 2,
                             "project name 'Not Valid' must be lowercase"),
    "the same file twice": Case({"c.yml": "services:\n" + SERVER}, ["c.yml", "./c.yml"], 2,
                                "c.yml: given twice; each file is one project"),
    "no input at all": Case({}, [], 2, "plan: give compose files, or --from-compose-config"),
    "compose config that is a source file": Case({"c.yml": "name: p\nservices:\n  a: {image: \"${IMG}\"}\n"},
                                                 ["--from-compose-config", "c.yml"], 2,
                                                 "still refers to ${IMG}; give plan the output of"),
    "compose config on stdin, garbage": Case({}, ["--from-compose-config", "-"], 2, "<stdin>: not UTF-8 text",
                                             stdin=b"\x80\x81"),
    "compose config on stdin, empty": Case({}, ["--from-compose-config", "-"], 2,
                                           "plan: cannot read --from-compose-config -: stdin is empty; "
                                           "pipe `docker compose config` into it", stdin=b""),
    "compose config on stdin, closed": Case({}, ["--from-compose-config", "-"], 2,
                                            "plan: cannot read --from-compose-config -: stdin is closed; "
                                            "pipe `docker compose config` into it", stdin_closed=True),
    "compose config on stdin, twice": Case({}, ["--from-compose-config", "-", "--from-compose-config", "-"], 2,
                                           "--from-compose-config -: given twice",
                                           stdin=b"name: p\nservices: {}\n"),
    "compose config without a name": Case({"c.json": '{"services": {}}'}, ["--from-compose-config", "c.json"], 2,
                                          "no top-level name: this is not `docker compose config` output"),
    # ---- problems found before any resolution: exit 1, still without importing sglang
    "unknown service": Case({"c.yml": "services:\n" + SERVER + "  web: {image: nginx}\n"}, ["c.yml"], 1,
                            "c.yml/web: is not an sglang server, router, Mooncake master or known helper"),
    "shell script plan cannot follow": Case({"c.yml": _yaml("""\
        services:
          server:
            image: img
            command: ["sh", "-c", "sglang serve --model-path /model --tp $(nproc)"]
        """)}, ["c.yml"], 1, "c.yml/server: its command is a shell script plan cannot follow (command substitution"),
    "shell script that installs first": Case({"c.yml": _yaml("""\
        services:
          server:
            image: img
            entrypoint: ["/bin/bash", "-lc"]
            command: ["pip install sglang==0.5.22 && sglang serve --model-path /model"]
        """)}, ["c.yml"], 1, "it runs 'pip' before the program"),
    "sh -c entrypoint with a string command": Case({"c.yml": _yaml("""\
        services:
          server:
            image: img
            entrypoint: ["sh", "-c"]
            command: "sglang serve --model-path /model --tp 2"
        """)}, ["c.yml"], 1, "the words after it are the script's positional parameters, not a command"),
    "container filters the plugin out": Case({"c.yml": _yaml("""\
        services:
          server:
            image: img
            environment: {SGLANG_PLUGINS: "other_plugin"}
            command: ["sglang", "serve", "--model-path", "/model"]
        """)}, ["c.yml"], 1, "c.yml/server: SGLANG_PLUGINS=other_plugin leaves out the dsv41 plugin"),
    "plugin filtered behind env": Case({"c.yml": _yaml("""\
        services:
          server:
            image: img
            command: ["env", "SGLANG_PLUGINS=none", "sglang", "serve", "--model-path", "/model"]
        """)}, ["c.yml"], 1, "c.yml/server: SGLANG_PLUGINS=none leaves out the dsv41 plugin"),
    "depends_on a missing service": Case({"c.yml": "services:\n" + SERVER + "    depends_on: [ghost]\n"},
                                         ["c.yml"], 1, "c.yml/server: depends_on ghost, which is not a service of c.yml"),
    "depends_on an inactive profile": Case({"c.yml": "services:\n" + SERVER + "    depends_on: [cache]\n"
                                            "  cache: {image: x, profiles: [extra], labels: {sglang-dsv41.ignore: 'true'}}\n"},
                                           ["c.yml"], 1, "depends_on cache, which is only in profile(s) extra"),
    "container_name collision": Case({"a.yml": "name: pa\nservices:\n" + SERVER + "    container_name: box\n",
                                      "b.yml": "name: pb\nservices:\n  other: {image: x, container_name: box, "
                                               "labels: {sglang-dsv41.ignore: 'true'}}\n"},
                                     ["a.yml", "b.yml"], 1, "b.yml/other: container_name box is also the container name of a.yml/server"),
    "project name collision": Case({"a.yml": "name: same\nservices:\n" + SERVER,
                                    "b.yml": "name: same\nservices:\n  x: {image: x, labels: [sglang-dsv41.ignore=true]}\n"},
                                   ["a.yml", "b.yml"], 1, "b.yml: project name 'same' is also the project of a.yml"),
    "project name from the directory": Case({"a.yml": "services:\n" + SERVER,
                                             "b.yml": "services:\n  x: {image: x, labels: [sglang-dsv41.ignore=true]}\n"},
                                            ["a.yml", "b.yml"], 1, "is also the project of a.yml"),
    "host network by service name": Case({"c.yml": _yaml("""\
        services:
          server:
            image: img
            network_mode: host
            environment: {MOONCAKE_MASTER: "master:50051"}
            command: ["sglang", "serve", "--model-path", "/model"]
          master:
            image: img
            command: ["mooncake_master", "--rpc_port=50051"]
        """)}, ["c.yml"], 1, "c.yml/server: runs on the host network but addresses master by its service name"),
    "GPU id beyond the node": Case({"c.yml": "services:\n" + SERVER + "    environment: {CUDA_VISIBLE_DEVICES: '8,9'}\n"
                                    "    deploy: {resources: {reservations: {devices: [{driver: nvidia, count: all, "
                                    "capabilities: [gpu]}]}}}\n"},
                                   ["c.yml"], 1, "c.yml/server: names GPU 8, 9, but a node has GPUs 0-7"),
    "GPU id beyond a smaller node": Case({"c.yml": "services:\n" + SERVER + "    deploy: {resources: {reservations: "
                                          "{devices: [{driver: nvidia, device_ids: ['2', '3'], capabilities: [gpu]}]}}}\n"},
                                         ["--gpus-per-node", "2", "c.yml"], 1, "names GPU 2, 3, but a node has GPUs 0-1"),
    "GPU count beyond the node": Case({"c.yml": "services:\n" + SERVER + "    deploy: {resources: {reservations: "
                                       "{devices: [{driver: nvidia, count: 12, capabilities: [gpu]}]}}}\n"},
                                      ["c.yml"], 1, "c.yml/server: reserves 12 GPUs, but a node has 8"),
    "one file, two hosts": Case({"c.yml": _yaml("""\
        services:
          a: {image: img, command: [sglang, serve], labels: {sglang-dsv41.host: node-a}}
          b: {image: img, command: [sglang, serve], labels: [sglang-dsv41.host=node-b]}
        """)}, ["c.yml"], 1, "c.yml: its services are labelled for hosts node-a, node-b, but one `docker compose up`"),
    "no server at all": Case({"c.yml": "services:\n  m: {image: x, command: [mooncake_master]}\n"}, ["c.yml"], 1,
                             "plan: no `sglang serve` service found in c.yml"),
}
