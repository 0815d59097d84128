"""`sglang-dsv41 upgrade-check` over real, edited copies of the installed sglang 0.5.23.

Each candidate is a temporary folder (or a zip of it) holding the 0.5.23 files the
fingerprints read, edited as a new release might edit them; upgrade-check reads it
without importing it and compares it with the installed pinned release.
"""

from __future__ import annotations

import json
import shutil
import zipfile

import pytest

from sglang_dsv41.plugin import drift as checks
from sglang_dsv41.plugin import fingerprint as fp
from sglang_dsv41.tools import upgrade_check as uc
from sglang_dsv41.plugin.table import by_id
from _upgrade_trees import append, copy_installed, edit, run_cli, status_lines, zip_as_wheel

pytestmark = pytest.mark.timeout(300)

MOONCAKE = "sglang/srt/disaggregation/mooncake/conn.py"
DETOK = "sglang/srt/managers/detokenizer_manager.py"
POLICY = "sglang/srt/managers/schedule_policy.py"
MODEL = "sglang/srt/models/deepseek_v4.py"
MM_SCHEDULE = "sglang/srt/managers/mm_schedule.py"
HOOK_REGISTRY = "sglang/srt/plugins/hook_registry.py"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return copy_installed(tmp_path_factory.mktemp("pristine"))


@pytest.fixture
def candidate(pristine, tmp_path):
    """A fresh copy of the pristine tree for one test to edit."""
    root = tmp_path / "candidate"
    shutil.copytree(pristine, root)
    return root


def report_for(root):
    return uc.build_report(fp.installed_tree(), fp.FolderTree(root), use_table=True)


def finding(report, patch_id):
    return next(f for f in report.patches + report.internals if f.id == patch_id)


def not_same(report):
    return {f.id for f in report.patches + report.internals if f.status != uc.SAME}


# ---------------------------------------------------------------- through the CLI


def test_unchanged_copy_is_all_same_and_exits_0(pristine):
    proc = run_cli(str(pristine))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = status_lines(proc.stdout)
    assert set(by_id()) <= set(lines)
    assert all(line.startswith("same") for pid, line in lines.items() if pid in by_id())
    assert "pinned internals (" in proc.stdout and " 0 changed" in proc.stdout
    assert proc.stdout.rstrip().endswith("nothing to review (exit 0)")


def test_body_edit_is_drift_with_a_diff_and_exits_1(candidate):
    edit(candidate, MOONCAKE,
         "        regions: List[Tuple[int, int]] = []\n",
         "        regions: List[Tuple[int, int]] = []\n        self._region_count = 0\n")
    proc = run_cli(str(candidate))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = status_lines(proc.stdout)
    assert lines["MC-NVL-REGIONS"].startswith("DRIFT")
    assert lines["MC-NVL-REGIONS"].endswith(": body")
    assert "### MC-NVL-REGIONS" in proc.stdout
    diff = proc.stdout.split("### MC-NVL-REGIONS", 1)[1]
    assert "--- sglang 0.5.23 sglang/srt/disaggregation/mooncake/conn.py (MooncakeKVManager._registerable_regions)" in diff
    assert "+        self._region_count = 0" in diff
    # Nothing else in that file changed for the other Mooncake patches.
    assert lines["MC-NVL-TRANSFER"].startswith("same") and lines["MC-NVL-AUX-RECV"].startswith("same")


def test_json_report(candidate):
    edit(candidate, MOONCAKE, "    def _handle_aux_data(self, msg: List[bytes]):",
         "    def _handle_aux_data(self, msg: List[bytes], strict: bool = False):")
    proc = run_cli(str(candidate), "--json")
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert set(data) == {"pinned", "candidate", "patches", "internals", "summary", "exit_code"}
    assert data["pinned"]["version"] == "0.5.23" and data["candidate"]["version"] == "0.5.23"
    assert data["candidate"]["source"] == str(candidate / "sglang")
    assert [p["id"] for p in data["patches"]] == list(by_id())
    for entry in data["patches"] + data["internals"]:
        assert set(entry) == {"id", "target", "status", "reasons", "depends_on", "diff", "note"}
        assert entry["status"] in ("same", "DRIFT", "GONE")
        assert (entry["status"] == "same") == (entry["reasons"] == [])
    drifted = {p["id"]: p for p in data["patches"] if p["status"] != "same"}
    assert set(drifted) == {"MC-NVL-AUX-RECV"}
    assert drifted["MC-NVL-AUX-RECV"]["reasons"] == ["signature"]
    assert "+    def _handle_aux_data(self, msg: List[bytes], strict: bool = False):" in \
        drifted["MC-NVL-AUX-RECV"]["diff"]
    counts = data["summary"]["patches"]
    assert counts == {"same": len(by_id()) - 1, "DRIFT": 1, "GONE": 0}
    assert data["exit_code"] == 1


def test_a_wheel_is_read_in_place(pristine, tmp_path):
    wheel = zip_as_wheel(pristine, tmp_path / "sglang-0.5.23-py3-none-any.whl")
    proc = run_cli(str(wheel))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"({wheel})" in proc.stdout.splitlines()[0]


@pytest.mark.parametrize("case", ["missing", "not-a-zip", "zip-without-sglang", "folder-without-sglang",
                                  "not-a-version", "bad-pinned"])
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, pristine):
    if case == "missing":
        args, expect = [str(tmp_path / "sglang-9.9.9-py3-none-any.whl")], "no such file or folder"
    elif case == "not-a-zip":
        bogus = tmp_path / "sglang-9.9.9-py3-none-any.whl"
        bogus.write_text("not a zip")
        args, expect = [str(bogus)], "not a wheel"
    elif case == "zip-without-sglang":
        other = tmp_path / "other-1.0-py3-none-any.whl"
        with zipfile.ZipFile(other, "w") as z:
            z.writestr("other/__init__.py", "")
        args, expect = [str(other)], "no sglang package inside the wheel"
    elif case == "folder-without-sglang":
        args, expect = [str(tmp_path)], "no sglang package inside"
    elif case == "not-a-version":
        args, expect = ["sglang-next"], "no such file or folder, and not a version"
    else:
        args, expect = [str(pristine), "--pinned", str(tmp_path / "nowhere")], "no such file"
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("upgrade-check: ") and expect in proc.stderr


def test_a_failed_download_is_one_line_and_exit_2(tmp_path):
    # An empty, local package index: pip finds no sglang and fails, offline.
    (tmp_path / "index").mkdir()
    env = {"PIP_CONFIG_FILE": "/dev/null", "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(tmp_path / "index")}
    proc = run_cli("0.5.24", env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith("upgrade-check: pip download sglang==0.5.24 failed: ")
    assert "0.5.24" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- verdicts, in process


def test_signature_edit_is_drift_naming_the_signature(candidate):
    edit(candidate, MODEL,
         "        input_embeds: Optional[torch.Tensor] = None,\n    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:\n"
         '        """Prepare full-sequence image embeddings',
         "        input_embeds: Optional[torch.Tensor] = None,\n        cp_ready: bool = False,\n"
         "    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:\n"
         '        """Prepare full-sequence image embeddings')
    report = report_for(candidate)
    fence = finding(report, "OWN-FENCE")
    assert fence.status == uc.DRIFT and fence.reasons[0] == "signature"
    assert "+        cp_ready: bool = False," in fence.diff
    # VCP-PREPARE delegates to this method: it is flagged through relies_on.
    prepare = finding(report, "VCP-PREPARE")
    assert prepare.status == uc.DRIFT
    assert prepare.reasons == ["relied-on prepare_language_model_inputs changed"]
    assert not_same(report) == {"OWN-FENCE", "VCP-PREPARE"}


@pytest.mark.parametrize("rebinding", [
    "MooncakeKVManager._transfer_data = MooncakeKVManager._handle_aux_data",
    'setattr(MooncakeKVManager, "_transfer_data", lambda self, *a: 0)',
])
def test_a_rebinding_at_module_end_is_seen(candidate, rebinding):
    append(candidate, MOONCAKE, rebinding)
    report = report_for(candidate)
    transfer = finding(report, "MC-NVL-TRANSFER")
    assert transfer.status == uc.DRIFT and transfer.reasons == ["re-bound"]
    assert f"+{rebinding}" in transfer.diff
    assert not_same(report) == {"MC-NVL-TRANSFER"}
    # The load-time check reads the same fingerprint: it would refuse this tree too.
    patch = by_id()["MC-NVL-TRANSFER"]
    assert fp.fingerprint_of(patch, fp.FolderTree(candidate)).ast_sha != patch.ast_sha


def test_a_module_level_reassignment_of_a_function_is_seen(candidate):
    append(candidate, MM_SCHEDULE,
           "_batch_encode_per_image_misses = functools.lru_cache(None)(_batch_encode_per_image_misses)")
    report = report_for(candidate)
    encode = finding(report, "OWN-ENCODE")
    assert encode.status == uc.DRIFT and encode.reasons == ["re-bound"]
    assert not_same(report) == {"OWN-ENCODE"}


def test_a_constructor_body_edit_leaves_activation_hooks_same(candidate):
    edit(candidate, DETOK, "        # Init inter-process communication\n        self.init_ipc_channels(port_args, server_args)\n",
         "        self.started_at = time.time()\n        self.init_ipc_channels(port_args, server_args)\n")
    assert not_same(report_for(candidate)) == set()


def test_a_constructor_signature_edit_flags_the_activation_hook(candidate):
    edit(candidate, DETOK, "        server_args: ServerArgs,\n        port_args: PortArgs,\n    ):\n"
         "        # Init inter-process communication",
         "        server_args: ServerArgs,\n        port_args: PortArgs,\n        ipc_only: bool = False,\n"
         "    ):\n        # Init inter-process communication")
    report = report_for(candidate)
    detok = finding(report, "ACT-DETOK")
    assert detok.status == uc.DRIFT and detok.reasons == ["signature"]
    # The diff shows the header the hook depends on, not the whole constructor.
    assert "+        ipc_only: bool = False," in detok.diff
    assert "init_ipc_channels" not in detok.diff


def test_a_name_newly_defined_upstream_is_drift_for_new_attribute(candidate):
    edit(candidate, POLICY, "class PrefillAdder:\n",
         "class PrefillAdder:\n    def can_share_extend_batch(self, req):\n        return True\n\n")
    report = report_for(candidate)
    share = finding(report, "EMB-CAN-SHARE")
    assert share.status == uc.DRIFT and share.reasons == ["name now defined upstream"]
    assert "+    def can_share_extend_batch(self, req):" in share.diff
    assert not_same(report) == {"EMB-CAN-SHARE"}


def test_a_class_body_edit_outside_what_new_attribute_relies_on_is_same(candidate):
    # The whole-class fingerprint used to flag this; the owner's other methods
    # are not what the new prepare_model_inputs depends on.
    edit(candidate, MODEL, "        Scheduler hash IDs stay intact for multimodal cache keys;",
         "        Scheduler hash IDs stay intact (for multimodal cache keys);")
    assert not_same(report_for(candidate)) == set()  # a docstring edit is no drift either
    edit(candidate, POLICY, "class PrefillAdder:\n", "class PrefillAdder:\n    unused_marker = 1\n")
    assert not_same(report_for(candidate)) == set()


def test_a_removed_target_is_gone(candidate):
    edit(candidate, MOONCAKE, "    def _handle_aux_data(self, msg: List[bytes]):",
         "    def _handle_aux_payload(self, msg: List[bytes]):")
    report = report_for(candidate)
    gone = finding(report, "MC-NVL-AUX-RECV")
    assert gone.status == uc.GONE and "'_handle_aux_data' is not defined" in gone.reasons[0]
    assert report.exit_code == 1


def test_a_changed_pinned_internal_is_listed(candidate):
    edit(candidate, HOOK_REGISTRY, "def _wrap_fn(", "def _wrap_hook_fn(")
    report = report_for(candidate)
    wrap = finding(report, "sglang.srt.plugins.hook_registry._wrap_fn")
    assert wrap.status == uc.GONE and "'_wrap_fn' is not defined" in wrap.reasons[0]
    listed = report.to_text().split("pinned internals", 1)[1]
    assert "GONE   sglang.srt.plugins.hook_registry._wrap_fn: " in listed
    assert report.exit_code == 1
    assert {f.id for f in report.patches if f.status != uc.SAME} == set()


def test_the_load_time_check_uses_the_upgrade_check_fingerprint(monkeypatch):
    """checks.patch_problems (run at plugin load) must call fingerprint_of, the
    function upgrade-check uses, not a second fingerprint of its own."""
    patch = by_id()["EMB-LOOKUP"]
    assert checks.patch_problems(patch) == []
    monkeypatch.setattr(fp, "fingerprint_of", lambda item, tree=None: fp.Fingerprint(item.signature, "0" * 16))
    assert any("source drifted" in p.message for p in checks.patch_problems(patch))


# ---------------------------------------------------------------- the tables themselves


def test_pinned_internals_match_the_installed_release_and_fail_on_an_edit(candidate):
    from sglang_dsv41.plugin import internals as pinned_internals

    for internal in pinned_internals.INTERNALS:
        assert pinned_internals.problems(internal) == [], internal.name
    edit(candidate, "sglang/srt/server_args.py", "ZMQ_TCP_PORT_DELTA = 233", "ZMQ_TCP_PORT_DELTA = 234")
    delta = next(i for i in pinned_internals.INTERNALS if i.name.endswith("ZMQ_TCP_PORT_DELTA"))
    assert pinned_internals.problems(delta, fp.FolderTree(candidate)) == [
        f"source drifted: expected ast sha {delta.ast_sha}, "
        f"found {fp.fingerprint_of(delta, fp.FolderTree(candidate)).ast_sha}"]


def test_every_patch_says_when_it_can_go():
    import re

    from sglang_dsv41.plugin.table import feature_of

    for patch in by_id().values():
        feature = feature_of(patch)  # a patch states its own only where it differs from its feature's
        assert feature.remove_when_of(patch).strip(), patch.id
        upstream = feature.upstream_of(patch)
        assert upstream is None or re.match(r"[\w.-]+/[\w.-]+#\d+ ", upstream), patch.id
        assert patch.depends_on in ("source", "signature"), patch.id
        if patch.new_attribute:
            for method in patch.relies_on:
                fp.resolve(f"{patch.fingerprint_target}.{method}")  # exists in the pinned release


def test_a_candidates_version_string_cannot_write_control_characters(candidate):
    (candidate / "sglang" / "_version.py").write_text("__version__ = '\\x1b[31mRED\\nnewline'\n")
    version = uc.describe(fp.FolderTree(candidate))["version"]
    assert version == "'\\x1b[31mRED\\nnewline'" and version.isprintable()
