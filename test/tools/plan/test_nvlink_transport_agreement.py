"""`plan` and the running server decide "Mooncake's intra-node NVLink transport" with one function.

The runtime asks ``mooncake_nvlink.routing.nvlink_intra_reason`` in the server's
own environment (host-block routing, KV staging); `plan` asks the same function
of each service's compose environment. sglang 0.5.23 picks Mooncake's transport
by ``MOONCAKE_PROTOCOL`` only, and Mooncake adds the intra-node NVLink one for
its own flag; ``SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK`` selects
neither (pinned in ``test/upstream_pins/test_mooncake_custom_pool_transport.py``),
so it does not count.
"""

from __future__ import annotations


import pytest

from conftest import REPO_ROOT
from sglang_dsv41.mooncake_nvlink import routing
from sglang_dsv41.tools.plan import checks
from sglang_dsv41.tools.plan.cli import container_environment, read_projects

DEPLOY = REPO_ROOT / "deploy" / "b300-ds41"
MASTER = "mooncake-master.yml"
SHIPPED = sorted(p.name for p in DEPLOY.glob("*.yml") if p.name != MASTER)

# Each shipped environment as it is, then with one transport setting changed.
VARIANTS = {
    "as shipped": {},
    "no flag": {"MC_INTRANODE_NVLINK": None},
    "old flag name": {"MC_INTRANODE_NVLINK": None, "MC_INTRA_NVLINK": "1"},
    "by protocol": {"MC_INTRANODE_NVLINK": None, "MOONCAKE_PROTOCOL": "nvlink_intra"},
    "custom pool only": {"MC_INTRANODE_NVLINK": None, "SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "INTRA_NODE_NVLINK"},
}


def pd_services(name: str):
    for project in read_projects([str(DEPLOY / MASTER), str(DEPLOY / name)]):
        for service in project.services:
            if any(arg.startswith("--disaggregation-mode") for arg in service.argv):
                yield service


def changed(environment: dict, change: dict) -> dict:
    env = dict(environment)
    for key, value in change.items():
        env.pop(key, None) if value is None else env.__setitem__(key, value)
    return env


def runtime_decision(service) -> str | None:
    """What the server's hooks decide, in the environment its container has."""
    with container_environment(service):
        return routing.nvlink_intra_reason()


@pytest.mark.parametrize("name", SHIPPED)
def test_plan_and_runtime_agree_for_every_shipped_topology(name):
    services = list(pd_services(name))
    if name.startswith("pd-"):
        assert services, f"{name}: no PD servers found"
    for service in services:
        shipped = dict(service.environment)
        for variant, change in VARIANTS.items():
            service.environment = changed(shipped, change)
            plan_says = checks.nvlink_intra_reason(service.environment)
            assert plan_says == runtime_decision(service), (name, service.label, variant)
            if variant == "as shipped":
                assert plan_says == "MC_INTRANODE_NVLINK is set", (name, service.label)
            if variant in ("no flag", "custom pool only"):
                assert plan_says is None, (name, service.label, variant)


def test_the_custom_memory_pool_setting_is_not_the_transport():
    # The value `plan` used to count: the runtime (and now plan) does not.
    assert checks.nvlink_intra_reason({"SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "INTRA_NODE_NVLINK"}) is None
    assert checks.nvlink_intra_reason({"MC_INTRA_NVLINK": ""}) == "MC_INTRA_NVLINK is set"
    assert checks.nvlink_intra_reason is routing.nvlink_intra_reason
